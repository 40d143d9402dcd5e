"""torchrun's arguments read without torch (``state/launcher.read_argv``), as the launcher's
record says them before torch loads: torchrun's own defaults, both spellings, both forms."""

from __future__ import annotations

from ddpmon.state.launcher import read_argv


def test_a_static_launch_with_its_defaults() -> None:
    r = read_argv(["--nproc_per_node", "2", "train.py", "--lr", "0.1"])
    assert (r.endpoint, r.rdzv_backend, r.nnodes, r.node_rank) == (
        "127.0.0.1:29500",
        "static",
        "1",
        0,
    )
    assert r.nproc_per_node == "2" and r.command == ["train.py", "--lr", "0.1"]
    assert r.rdzv_id is None and r.starts_python


def test_two_nodes_by_master_address() -> None:
    r = read_argv(
        [
            "--nnodes=2",
            "--node-rank=1",
            "--master-addr",
            "10.0.0.1",
            "--master_port=29611",
            "-m",
            "pkg.train",
        ]
    )
    assert (r.endpoint, r.nnodes, r.node_rank) == ("10.0.0.1:29611", "2", 1)
    assert r.command == ["pkg.train"]


def test_a_rendezvous_endpoint_elastic_and_standalone() -> None:
    r = read_argv(
        ["--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--rdzv-id=7", "t.py"]
    )
    assert (r.endpoint, r.rdzv_backend, r.nnodes, r.node_rank, r.rdzv_id) == (
        "h:29400",
        "c10d",
        "1:4",
        None,
        "7",
    )
    r = read_argv(["--standalone", "--nnodes=2:2", "--no-python", "t.py"])
    assert (r.endpoint, r.rdzv_backend, r.nnodes, r.starts_python) == (
        "localhost:0",
        "c10d",
        "2",
        False,
    )
