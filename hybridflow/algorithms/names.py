"""The config names of the algorithm registries, importable without torch (configs validate against them).

Each tuple lists the keys of the registry it names, in order; tests/test_config_light.py keeps them equal.
"""

POLICY_LOSS_NAMES = ("ppo", "gspo", "cispo")
"""Keys of ``losses.POLICY_LOSSES``."""
LOSS_AGGREGATION_NAMES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Keys of ``masked.LOSS_AGGREGATIONS``."""
KL_ESTIMATOR_NAMES = ("k1", "abs", "k2", "mse", "k3", "low_var_kl")
"""Keys of ``kl.KL_ESTIMATORS``."""
NON_FINITE_ACTIONS = ("raise", "skip")
"""What a training step does with a non-finite loss or gradient norm (``finite.check_non_finite_action``)."""
