"""Megatron integration tests: skipped when megatron-core is not installed."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")
