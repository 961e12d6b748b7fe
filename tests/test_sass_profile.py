"""scripts/sass_profile.py: the run-length summary of tagged SASS instructions, and (where
nvdisasm is installed) one real sm_90a attention kernel profiled on the CPU."""

import pytest

from script_loader import load_script

sp = load_script("sass_profile.py", "sass_profile")

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   WARPGROUP.ARRIVE ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0050*/                   FMNMX R3, R24, R25, !PT ;
        /*0060*/                   SHFL.BFLY PT, R4, R3, 0x1, 0x1f ;
        /*0070*/                   MUFU.EX2 R5, R5 ;
        /*0080*/                   MUFU.EX2 R6, R6 ;
        /*0090*/               @P0 BRA 0x10 ;
"""


def test_runs_counts_and_orders_tagged_instructions():
    order, totals = sp.runs(SASS)
    assert order == ("WARPGROUP.ARRIVEx1 HGMMAx2 WARPGROUP.DEPBARx1 FMNMXx1 SHFLx1 "
                     "MUFU.EX2x2 BRAx1")
    assert totals["HGMMA"] == 2 and totals["MUFU.EX2"] == 2 and totals["SYNCS"] == 0


@pytest.mark.skipif(sp.find_nvdisasm() is None, reason="needs nvdisasm")
def test_default_kernel_profile(capsys):
    assert sp.main(["--variant", "7"]) == 0
    out = capsys.readouterr().out
    totals = dict(kv.split("=") for kv in out.splitlines()[0].split()[1:])
    assert int(totals["HGMMA"]) > 0 and int(totals["MUFU.EX2"]) >= 32
    assert "HGMMAx" in out.splitlines()[1]


@pytest.mark.skipif(sp.find_nvdisasm() is None, reason="needs nvdisasm")
def test_pinned_pv_wait_profile(capsys):
    """``--pin-pv-wait on`` profiles the pinned-wait kernel: in its steady state the exp2s
    come before the second wgmma wait; ``off`` is the default kernel, where ptxas hoists it."""
    from test_pin_pv_wait_cpu import exps_before_pv_wait

    assert sp.main(["--variant", "7", "--unpacked", "--consumers", "2",
                    "--pin-pv-wait", "on"]) == 0
    pinned = capsys.readouterr().out.splitlines()[1]
    assert sp.main(["--variant", "7", "--unpacked", "--consumers", "2",
                    "--pin-pv-wait", "off"]) == 0
    plain = capsys.readouterr().out.splitlines()[1]
    as_sass = {name: "\n".join(f"/*0000*/ {tag}" for run in order.split()[1:]
                               for tag in [run.rsplit("x", 1)[0]]
                               for _ in range(int(run.rsplit("x", 1)[1])))
               for name, order in (("pinned", pinned), ("plain", plain))}
    assert exps_before_pv_wait(as_sass["pinned"]) >= 32
    assert exps_before_pv_wait(as_sass["plain"]) == 0


LOOPS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   WARPGROUP.ARRIVE ;
.L_x_2:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, R120, gdesc[UR8].tnspB, R24 ;
        /*0040*/               @!P1 BRA `(.L_x_3) ;
        /*0050*/                   ISETP.GT.AND P6, PT, R142, R21, PT ;
        /*0060*/                   FSEL R89, R89, -INF , !P6 ;
.L_x_3:
        /*0070*/                   FMNMX R3, R24, R25, !PT ;
        /*0074*/              @!UP0 BRA `(.L_x_5) ;
        /*0078*/                   FADD R10, R10, R11 ;
.L_x_5:
        /*0080*/                   MUFU.EX2 R5, R5 ;
        /*0090*/               @P0 FMUL R6, R6, R7 ;
        /*00a0*/               @P2 BRA `(.L_x_2) ;
        /*00b0*/                   FADD R8, R8, R9 ;
        /*00c0*/               @P3 BRA `(.L_x_1) ;
.L_x_4:
        /*00d0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*00e0*/               @P4 BRA `(.L_x_4) ;
"""


def test_loop_mix_takes_the_shortest_loop_with_mma_and_exp2():
    lm = sp.loop_mix(LOOPS)
    # .L_x_2 .. its BRA (11 instructions); the outer loop is longer, .L_x_4 has no exp2;
    # the mask (2) and the uniform-predicated skip (1) are guarded
    assert lm["len"] == 11 and lm["guarded"] == 3
    assert lm["hgmma"] == {"HGMMA.64x64x16.F32.BF16": 1, "HGMMA.64x128x16.F32.BF16": 1}
    assert lm["counts"]["FMUL"] == 1 and lm["counts"]["BRA"] == 3  # predicates stripped
    assert lm["counts"]["FADD"] == 1  # the FADD after the loop's branch is outside
    assert sp.loop_mix(SASS) is None  # a forward-only listing has no loop


def test_loop_mix_of_a_listing_file(tmp_path, capsys):
    f = tmp_path / "k.sass"
    f.write_text(LOOPS)
    assert sp.main(["--sass-file", str(f), "--loop-mix"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("loop mix: 11 instructions (3 behind forward branches)")
    assert "MUFU.EX2:1" in out[3]


@pytest.mark.skipif(sp.find_nvdisasm() is None, reason="needs nvdisasm")
def test_default_prefill_kernel_loop_mix(capsys):
    """The steady state of the default prefill kernel (128-row, unpacked): one 64-key page
    a trip, QK^T as 8 m64n64k16 and PV as 4 m64n128k16 (D = 128), and the page's 32 exp2
    a thread plus the two row corrections; the mask sits behind a branch."""
    assert sp.main(["--variant", "7", "--unpacked", "--consumers", "2", "--loop-mix"]) == 0
    out = capsys.readouterr().out.splitlines()
    mix = dict(kv.split(":") for kv in out[3].strip().split(", "))
    assert int(mix["HGMMA.64x64x16.F32.BF16"]) == 8
    assert int(mix["HGMMA.64x128x16.F32.BF16"]) == 4
    assert int(mix["MUFU.EX2"]) == 34
    guarded = int(out[2].split("(")[1].split()[0])
    assert guarded >= 64  # 32 compares + 32 selects of the boundary mask


def test_wgmma_waits_counts_group_ends():
    assert sp.wgmma_waits(SASS) == (2, 0)
    serial = SASS.replace("R24 ;", "R24, gsb0 ;").replace("RZ ;", "RZ, gsb0 ;")
    assert sp.wgmma_waits(serial) == (2, 2)


@pytest.mark.skipif(sp.find_nvdisasm() is None, reason="needs nvdisasm")
def test_default_fused_kernels_keep_wgmma_groups(capsys):
    """The 192-row fused kernels the engine's prefill steps run, with either straddle copy,
    issue their wgmma in groups (one gsb0 a group: 4 of 24); the skip_idle experiment's
    conditional issue sites make ptxas serialize all 24, which is why it lost 20-30% on
    the H200 (bench/notes.md, eighteenth session)."""
    base = ["--variant", "7", "--unpacked", "--consumers", "3", "--fused"]
    seen = {}
    for name, extra in (("default", []), ("vec", ["--vec-straddle"]),
                        ("skip_idle", ["--skip-idle"])):
        assert sp.main(base + extra) == 0
        line = [ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("wgmma:")][0]
        g, n = (int(x) for x in line.split()[1:4:2])
        seen[name] = (g, n)
    assert seen["default"] == seen["vec"] == (4, 24)
    assert seen["skip_idle"] == (24, 24)
