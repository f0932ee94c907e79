"""reports/wgmma_wait_probe.overlap counts the exponentials between each P.V product's first
instruction and its full wait (the probe itself compiles with ptxas and is run by hand:
`python -m reports.wgmma_wait_probe`)."""

from reports.wgmma_wait_probe import overlap

SASS = """
        /*0100*/                   HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0110*/                   MUFU.EX2 R1, R1 ;
        /*0120*/                   HGMMA.64x128x16.F32.BF16 R24, R164, gdesc[UR4].tnspB, R24 ;
        /*0128*/                   MUFU.EX2 R5, R5 ;
        /*0130*/                   HGMMA.64x128x16.F32.BF16 R24, R160, gdesc[UR4].tnspB, R24, gsb0 ;
        /*0140*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0150*/                   MUFU.EX2 R2, R2 ;
        /*0160*/                   MUFU.EX2 R3, R3 ;
        /*0170*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0180*/                   MUFU.EX2 R4, R4 ;
        /*0190*/                   HGMMA.64x128x16.F32.BF16 R24, R164, gdesc[UR4].tnspB, R24, gsb0 ;
        /*01a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_overlap_counts_exponentials_from_each_p_v_products_first_instruction_to_its_full_wait():
    assert overlap(SASS) == [3, 0]
