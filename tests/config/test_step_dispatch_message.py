"""A SchedulerOutput without ``scheduled_new_reqs`` is named like every other missing attribute."""

from types import SimpleNamespace

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline


def test_missing_scheduled_new_reqs_is_named():
    pipe = MetadataPipeline(DSV4Layout.from_config("tiny", max_model_len=64), 2, 8, "cpu")
    so = SimpleNamespace(scheduled_cached_reqs=None, num_scheduled_tokens={}, finished_req_ids=set())
    with pytest.raises(ValueError, match=r"got SimpleNamespace \(no attribute 'scheduled_new_reqs', which a "
                                         r"SchedulerOutput has\)"):
        pipe.update(so)
    assert pipe.last_batch is None
