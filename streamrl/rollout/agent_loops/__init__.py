"""verl's agent-loop API in the rollout workers (``rollout.agent``): a user's agent-loop classes,
written against verl's ``AgentLoopBase`` (or, without verl, against ``base``'s copy with verl's
names), run per sample with a server manager whose ``generate`` goes to the worker's backend.
See ``runner`` for how a prompt's loop is picked and how its output becomes a trajectory."""

from __future__ import annotations

from streamrl.rollout.agent_loops.base import (AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, DictConfigWrap,
                                               TokenOutput, ToolListWrap, register)
from streamrl.rollout.agent_loops.runner import BUILTIN, AgentLoops
from streamrl.rollout.agent_loops.server import EpisodeServer

__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "AgentLoops", "BUILTIN", "DictConfigWrap",
           "EpisodeServer", "TokenOutput", "ToolListWrap", "register"]
