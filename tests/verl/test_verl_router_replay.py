"""verl's MoE router replay keys (issue 66): ``rollout.enable_rollout_routing_replay`` and the
actor engine's ``router_replay.mode`` (R2 / R3) map onto ``rollout.return_routed_experts`` and
``learner.router_replay``; what verl itself refuses is refused naming the key."""

from __future__ import annotations

from streamrl.verl import read_verl_keys
from streamrl.verl.rows import IGNORED, MAPPED, REFUSED
from tests.helpers import dry_run

ROLLOUT = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
MODE = "actor_rollout_ref.actor.{}.router_replay.mode"


def test_a_verl_script_with_rollout_routing_replay_dry_runs_and_says_what_is_used(tmp_path):
    for engine in ("megatron", "veomni"):
        code, out, err = dry_run([f"actor_rollout_ref.actor.strategy={engine}", f"{ROLLOUT}=True",
                                  f"{MODE.format(engine)}=R3", "trainer.total_epochs=1"], tmp_path)
        assert code == 0, err
        assert "router_replay: R3" in out and "return_routed_experts: true" in out
        assert f"{MODE.format(engine)}" in out + err and "learner.router_replay" in out + err


def test_the_modes_as_verl_reads_them():
    def sets(*given):
        return {k: v for o in read_verl_keys(list(given)) if o.kind == MAPPED for k, v in o.sets.items()}

    assert sets(("actor_rollout_ref.actor.strategy", "megatron"), (MODE.format("megatron"), "R2")) == \
        {"learner.router_replay": "R2"}
    # verl's FSDP engine reads no router_replay section: the mode changes nothing there
    assert "learner.router_replay" not in sets((MODE.format("megatron"), "R2"), ("model_engine", "dp"))
    assert sets((ROLLOUT, True)) == {"rollout.return_routed_experts": True}
    refused = [
        [("actor_rollout_ref.actor.strategy", "megatron"), (ROLLOUT, True), (MODE.format("megatron"), "R2")],
        [("actor_rollout_ref.actor.strategy", "veomni"), (MODE.format("veomni"), "R3")],  # no rollout routing
        [("actor_rollout_ref.actor.strategy", "megatron"), ("actor_rollout_ref.actor.megatron.router_replay"
                                                            ".record_file", "/tmp/routes.pt")],
    ]
    for given in refused:
        outcomes = read_verl_keys(given)
        assert outcomes[-1].kind == REFUSED, outcomes[-1].line()
    for key in ("actor_rollout_ref.ref.megatron.router_replay.mode", "critic.veomni.router_replay.mode"):
        [o] = read_verl_keys([(key, "R3")])
        assert o.kind == IGNORED and "replay no routing" in o.why


def test_r3_has_the_rollout_record_the_routing_it_replays(tmp_path):
    code, out, err = dry_run(["learner.router_replay=R3"], tmp_path)
    assert code == 0, err
    assert "router_replay: R3" in out and "return_routed_experts: true" in out
    code, out, err = dry_run(["learner.router_replay=R4"], tmp_path)
    assert code == 2 and "learner.router_replay" in err
