"""The k policies, one module each, and their registry: a name -> the class implementing KPolicy.

Adding a policy is one module here and one line below. Configs, per-request overrides and the CLI take their
choices from this registry; which proposers a policy works with, its class declares (`KPolicy.unsupported`).
"""

from __future__ import annotations

from specd.speculation.k_policy import KPolicy
from specd.speculation.policies.adaptive import AdaptiveK
from specd.speculation.policies.confidence import ConfidenceK
from specd.speculation.policies.fixed import FixedK
from specd.speculation.policies.goodput import GoodputK
from specd.speculation.policies.heuristic import HeuristicK

K_POLICIES: dict[str, type[KPolicy]] = {
    "fixed": FixedK,
    "heuristic": HeuristicK,
    "confidence": ConfidenceK,
    "goodput": GoodputK,
    "adaptive": AdaptiveK,
}
