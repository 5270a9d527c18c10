"""bench_deepgemm_layouts: the swept rows, the shapes of the configurations' expert GEMMs, and each shape's
layouts and settling point read from DeepGEMM's DG_PRINT_CONFIGS lines (a fake child process; the sweep itself
runs on a Hopper GPU with DeepGEMM)."""

import subprocess

import bench_deepgemm_layouts as bench

LAYOUT = "GemmConfig(layout=Layout(swap_ab=0, block_m=128, block_n={}, block_k=128, cluster_m=2, cluster_n=1), x=1"


def line(m, block_n, n=768, k=2048, groups=32):
    return (f"GemmDesc(gemm_type=1, kernel_type=1, m={m}, n={n}, k={k}, num_groups={groups}, major_a=0): "
            f"{LAYOUT.format(block_n)}, LayoutInfo(num_waves=1)")


def test_rows_and_shapes():
    rows = bench.sweep_rows(100000)
    assert rows[:2] == [128, 256] and 65536 in rows and rows[-1] == 100000 and rows == sorted(set(rows))
    assert all(r % 128 == 0 for r in rows[:-1])
    shapes = bench.expert_shapes()
    assert (1536, 2048, 32) in shapes and (2048, 768, 32) in shapes  # qwen3_moe_like: fc1, fc2
    assert (4096, 7168, 32) in shapes and (7168, 4096, 32) in shapes  # dsv3_ep8_rank: fc1, dgrad of fc1


def test_settled_from_is_where_the_large_rows_layout_holds_for_good(monkeypatch):
    text = "\n".join([line(128, 112), line(256, 192), line(384, 160), line(512, 192), line(640, 192),
                      "other output", line(768, 192)])

    def fake_run(cmd, stdout, stderr, env):
        assert env["DG_PRINT_CONFIGS"] == "1" and cmd[-5:-2] == ["768", "2048", "32"]
        stdout.write(text)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    row = bench.run_shape((768, 2048, 32), 768)
    assert row["settled_from"] == 512 and row["swept"] == 6 and row["max_rows"] == 768
    assert [(x["rows_min"], x["rows_max"], x["calls"]) for x in row["layouts"]] == [(256, 768, 4), (384, 384, 1),
                                                                                     (128, 128, 1)]
    assert bench.layout(row["layouts"][0]["config"]) == "swap_ab=0 block_n=192 cluster_m=2 cluster_n=1"


def test_a_failed_child_is_a_row_with_its_output(monkeypatch):
    def fake_run(cmd, stdout, stderr, env):
        stdout.write("ImportError: no deep_gemm")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    row = bench.run_shape((768, 2048, 32), 768)
    assert row["rc"] == 1 and "no deep_gemm" in row["error"] and "settled_from" not in row
