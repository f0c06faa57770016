"""The proposers' registry -- a name -> how to build it and what it is -- and the checks and builders that join
proposers with k policies (whose registry is speculation.policies.K_POLICIES).

Adding a proposer is one module (a class implementing Proposer, declaring its ProposerTraits, and a builder) and
one line in PROPOSERS. The engine only ever sees the built objects; nothing outside this package names one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from specd.speculation.draft import DraftModelProposer, build_draft, build_layerskip
from specd.speculation.eagle import EagleProposer, build_eagle
from specd.speculation.hybrid import HybridProposer, build_hybrid
from specd.speculation.k_policy import KPolicy
from specd.speculation.ngram import NgramProposer, build_ngram
from specd.speculation.policies import K_POLICIES
from specd.speculation.proposer import Proposer, ProposerTraits

if TYPE_CHECKING:
    from specd.config import EngineConfig, SpeculationConfig
    from specd.model.llama import LlamaForCausalLM
    from specd.model.tokenizer import Tokenizer

ProposerBuilder = Callable[["EngineConfig", "LlamaForCausalLM", "Tokenizer | None"], Proposer]


class ProposerEntry(NamedTuple):
    """A registered proposer: what it is (its traits, read before anything is built) and how to build it."""

    traits: ProposerTraits
    build: ProposerBuilder


PROPOSERS: dict[str, ProposerEntry] = {
    "ngram": ProposerEntry(NgramProposer.traits, build_ngram),
    "draft": ProposerEntry(DraftModelProposer.traits, build_draft),
    "layerskip": ProposerEntry(DraftModelProposer.traits, build_layerskip),
    "eagle": ProposerEntry(EagleProposer.traits, build_eagle),
    "hybrid": ProposerEntry(HybridProposer.traits, build_hybrid),
}


def k_policy_unsupported(policy: str, traits: ProposerTraits) -> str | None:
    """Why registered policy `policy` cannot run with a proposer that has `traits` (None: it can)."""
    return K_POLICIES[policy].unsupported(traits)


def supporting_methods(policy: str) -> list[str]:
    """The registered proposers a policy works with, for error messages."""
    return [name for name, entry in PROPOSERS.items() if k_policy_unsupported(policy, entry.traits) is None]


def build_proposer(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> Proposer:
    """The configured proposer (speculation must be on: config.speculation.method is a registered name)."""
    return PROPOSERS[config.speculation.method].build(config, target, tokenizer)


def build_k_policies(spec: SpeculationConfig, traits: ProposerTraits) -> dict[str, KPolicy]:
    """One instance of every registered policy that works with a proposer of `traits`, by name."""
    return {name: policy.from_config(spec, traits)
            for name, policy in K_POLICIES.items() if policy.unsupported(traits) is None}
