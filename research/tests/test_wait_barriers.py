"""``research/wait_barriers.py``: only a barrier whose next instruction is an mbarrier wait goes (as Triton 3.6
writes them: the wait's loop in inline assembly after the barrier), others stay; and the stand-in kernel launches
the compiled variant from its stripped PTX while on, the kernel itself while off."""
from __future__ import annotations

from types import SimpleNamespace

from research.wait_barriers import Stripped, strip_wait_barriers

PTX = """\tbfe.u32 \t%r23, %r30, 1, 1;
\t.loc\t1 14 38                         // k.py:14:38
\tbar.sync \t0, 128;
\t// begin inline asm
\t
{
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [%r22], %r23;
\t@!complete bra.uni waitLoop;
}
\t// end inline asm
\tadd.s32 \t%r24, %r27, 64;
\tbar.sync \t0, 128;
\t// begin inline asm
\t@%p6 mbarrier.arrive.shared::cta.b64 _, [%r24];
\t// end inline asm
\tbarrier.sync \t1;
\tst.shared.b32 \t[global_smem+80], 50529027;
"""


def test_only_the_barriers_before_waits_go():
    text, deleted = strip_wait_barriers(PTX)
    assert deleted == 1
    assert text.count("bar.sync") == 1 and "barrier.sync \t1;" in text  # the arrive's and the other one stay
    assert text.splitlines() == [line for i, line in enumerate(PTX.splitlines()) if i != 2]
    assert strip_wait_barriers(text) == (text, 0)


class _Kernel:
    """A stand-in for a JIT kernel: records launches; a warm-up returns a compiled variant with PTX."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid):  # noqa: ANN001
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if warmup:
            return SimpleNamespace(hash="abc", asm={"ptx": PTX})
        self.launches.append({"grid": grid, "args": args, **kwargs})
        return None


def test_stand_in_launches_the_stripped_build_while_on(tmp_path):
    kernel = _Kernel()
    proxy = Stripped(kernel, tmp_path)
    proxy[(4,)](1, 2, BLOCK_M=16)
    assert kernel.launches[-1] == {"grid": (4,), "args": (1, 2), "BLOCK_M": 16}
    proxy.on = True
    proxy[(4,)](1, 2, BLOCK_M=16)
    override = kernel.launches[-1].pop("ir_override")
    assert kernel.launches[-1] == {"grid": (4,), "args": (1, 2), "BLOCK_M": 16}
    assert override == str(tmp_path / "abc.ptx") and proxy.deleted == {"abc.ptx": 1}
    assert (tmp_path / "abc.ptx").read_text() == strip_wait_barriers(PTX)[0]
