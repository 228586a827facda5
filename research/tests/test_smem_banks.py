"""``research/smem_banks.py``'s address evaluation and bank model on hand-written PTX whose wavefronts are known:
a row a lane 128 bytes apart (every lane of a phase in the same banks), the same rows with their 16-byte units
XORed with the row (no conflict), a warp-uniform address (a broadcast), 8-byte accesses of four rows a phase, and
``ldmatrix``'s eight rows a matrix; ``bfe.s32`` sign-extends, as the kernels' address arithmetic relies on."""
from __future__ import annotations

import random

from research.smem_banks import Evaluator, accesses, wavefronts

PTX = """
\t.loc\t1 10 0                          // kernel.py:10:0
\tmov.u32 \t%r1, %tid.x;
\tshl.b32 \t%r2, %r1, 7;
\tst.shared.v4.b32 \t[%r2+1024], {%r9, %r9, %r9, %r9};
\tand.b32 \t%r3, %r1, 7;
\tshl.b32 \t%r4, %r3, 4;
\txor.b32 \t%r5, %r2, %r4;
\t.loc\t1 12 0                          // kernel.py:12:0
\tst.shared.v4.b32 \t[%r5+1024], {%r9, %r9, %r9, %r9};
\tmov.b32 \t%r6, 2048;
\tld.shared.b32 \t%r7, [%r6];
\tshr.u32 \t%r10, %r1, 2;
\tshl.b32 \t%r11, %r10, 9;
\tand.b32 \t%r12, %r1, 3;
\tmad.lo.s32 \t%r13, %r12, 8, %r11;
\tst.shared.v2.b32 \t[%r13], {%r9, %r9};
\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r20, %r21, %r22, %r23}, [%r2];
\tbfe.s32 \t%r30, %r1, 1, 1;
\tand.b32 \t%r31, %r30, 160;
"""


def test_wavefronts_of_known_patterns():
    found = accesses(PTX)
    assert [(a.op, a.width) for a in found] == [("st.shared", 16), ("st.shared", 16), ("ld.shared", 4),
                                               ("st.shared", 8), ("ldmatrix", 16)]
    rows, swizzled, broadcast, quads, matrix = found
    assert rows.addresses[:3] == [1024, 1152, 1280] and rows.source == "kernel.py:10:0"
    assert (rows.wavefronts, rows.ideal) == (32, 4)  # 8 lanes a phase in banks 0-3
    assert (swizzled.wavefronts, swizzled.ideal) == (4, 4) and swizzled.source == "kernel.py:12:0"
    assert (broadcast.wavefronts, broadcast.ideal) == (1, 1)
    assert (quads.wavefronts, quads.ideal) == (8, 2)  # rows 512 bytes apart: four rows' 32 bytes in 8 banks
    assert (matrix.wavefronts, matrix.ideal) == (32, 4)


def test_bfe_sign_extends():
    values = Evaluator(PTX.splitlines())
    assert [values.register("%r31", tid) for tid in range(4)] == [0, 0, 160, 160]
    assert values.register("%r30", 2) == 0xFFFFFFFF


def test_wavefronts_bound_by_phases_and_lanes():
    """Fresh random addresses: never under one wavefront a phase, never over a phase's lanes times its words."""
    rng = random.Random()
    for _ in range(200):
        width = rng.choice([4, 8, 16])
        per_phase = 128 // width if width > 4 else 32
        addresses = [width * rng.randrange(0, 4096 // width) for _ in range(32)]
        count, ideal = wavefronts(addresses, width, per_phase)
        assert ideal == 32 // per_phase
        assert ideal <= count <= 32 * max(1, width // 4)
        assert wavefronts([addresses[0]] * 32, width, per_phase) == (ideal, ideal)  # one address: a broadcast
