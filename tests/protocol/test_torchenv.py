"""The base environment a node's agent gives the processes it starts (coordinator/torch_env.py)."""

from __future__ import annotations

from nonstop.protocol.torchrun import RANK_VARS, without_rank_vars


def test_an_agent_passes_on_none_of_torchruns_rank_variables_it_inherited() -> None:
    inherited = {k: "7" for k in RANK_VARS} | {"PATH": "/bin", "MASTER_ADDR": "10.0.0.1", "NONSTOP_X": "1"}
    assert without_rank_vars(inherited) == {"PATH": "/bin", "MASTER_ADDR": "10.0.0.1", "NONSTOP_X": "1"}
