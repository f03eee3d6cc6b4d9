"""Publication by a collective (`runtime.publication`), the parts that need no cluster: the weights flattened into one
buffer per dtype and back, bit for bit; the staging between the publication thread and the main queue; which
devices a publication broadcasts to under each setting. The runs that publish by broadcast are in test_cluster.py."""

import threading

import numpy as np
import pytest
import torch

from dovetail.runtime.publication import Publication, Staging, empty_buffers, flatten, layout_of, unflatten


def test_flattened_weights_come_back_bit_for_bit_one_buffer_per_dtype():
    rng = np.random.default_rng(0)
    weights = {
        "b.weight": rng.standard_normal((3, 4)).astype(np.float32),
        "a.bias": rng.standard_normal(5).astype(np.float32),
        "steps": np.arange(7, dtype=np.int64).reshape(7, 1),
        "scalar": np.float32(np.nan).reshape(()),
        "half": rng.standard_normal((2, 2)).astype(np.float16),
    }
    buffers = flatten(weights, torch.device("cpu"))
    assert [b.dtype for b in buffers] == [torch.float32, torch.float16, torch.int64]  # in the layout's order
    layout = layout_of(weights)
    assert [b.numel() for b in empty_buffers(layout, torch.device("cpu"))] == [b.numel() for b in buffers]
    back = unflatten(buffers, layout)
    assert back.keys() == weights.keys()
    for name, array in weights.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        assert back[name].tobytes() == array.tobytes(), name


def test_the_staging_hands_a_version_over_once_it_arrives_and_raises_a_failed_broadcast():
    staging = Staging()
    arrived = {"w": np.ones(2, dtype=np.float32)}
    threading.Timer(0.05, staging.put, (3, arrived)).start()
    assert staging.take(3, timeout_s=5) is arrived
    staging.put(4, ConnectionError("a member died"))
    with pytest.raises(ConnectionError):
        staging.take(4, timeout_s=5)
    with pytest.raises(TimeoutError):
        staging.take(5, timeout_s=0.01)


def test_a_publication_broadcasts_where_its_setting_says():
    nodes = lambda: ["a", "a", "b", "b"]  # noqa: E731
    targets = (0, 1, 2, 3)
    assert Publication("object_store", "object_store").receivers(0, targets, nodes) == ()
    assert Publication("collective", "collective").receivers(1, targets, nodes) == (1, 0, 2, 3)
    # auto broadcasts across nodes alone: on the sender's node the object store is shared memory
    assert Publication("auto", "collective", 0.2, 0.1).receivers(0, targets, nodes) == (0, 2, 3)
    assert Publication("auto", "collective", 0.2, 0.1).receivers(0, (0, 1), nodes) == ()
    assert Publication("auto", "object_store", 0.1, 0.2).receivers(0, targets, nodes) == ()
