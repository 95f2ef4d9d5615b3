"""Every rule row reached by PyTorch's operator samples (op_db) checked against ground truth;
how the samples are chosen and what is skipped is in :mod:`tests.passes.opdb_samples`."""

import importlib.util

import pytest

from tests.passes.opdb_samples import validate_op_db

HAS_EXPECTTEST = importlib.util.find_spec("expecttest") is not None


@pytest.mark.skipif(not HAS_EXPECTTEST, reason="op_db needs expecttest (pip install -e '.[test]')")
def test_every_rule_row_matches_the_whole_tensor_result_on_op_db_samples():
    report = validate_op_db()
    print(report.summary())
    failures = "\n".join(report.failures)
    assert not report.failures, f"{len(report.failures)} wrong rows\n{failures}\n{report.summary()}"
    assert len(report.registered_validated) >= 50, report.summary()
    assert report.rows >= 4000, report.summary()
