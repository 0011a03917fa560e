"""Helpers shared by the tests, the benchmarks and the demo, and the sandbox backend contract users run on their
own backend (`backend_contract`); never imported by the data path."""

import sys

if "pytest" in sys.modules:  # under pytest: the contract's failed asserts show their values, as a test module's do
    sys.modules["pytest"].register_assert_rewrite("swe_grpo.testing.backend_contract")
