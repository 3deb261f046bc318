"""train.checkpoints: exact round trip, pruning, atomic saves, and every kind of damage named."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from train.checkpoints import STATE_FILE, CheckpointError, CheckpointStore


def _state(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "micro_step": jnp.int32(seed),
        "params": {"fc": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "norm": jnp.asarray(rng.normal(size=4), jnp.bfloat16)},
        "opt_state": (jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), jnp.int32(7)),
    }


def test_round_trip_is_exact_and_keeps_the_newest(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", keep=2)
    for step in (1, 2, 3):
        store.save(step, _state(step))
    assert store.steps() == [2, 3] and store.latest_step() == 3
    restored = store.restore(3, _state(0))
    np.testing.assert_array_equal(restored["params"]["fc"], np.asarray(_state(3)["params"]["fc"]))
    assert restored["params"]["norm"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(restored["params"]["norm"], np.asarray(_state(3)["params"]["norm"]))
    assert int(restored["micro_step"]) == 3 and int(restored["opt_state"][1]) == 7


def test_an_unfinished_save_is_not_a_step(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.save(1, _state())
    (tmp_path / "2.partial").mkdir()  # a save the process did not finish
    assert store.steps() == [1]
    assert CheckpointStore(tmp_path, keep=2).steps() == [1] and not (tmp_path / "2.partial").exists()  # cleared on open


def test_a_changed_byte_fails_the_digest(tmp_path):
    store = CheckpointStore(tmp_path, keep=1)
    file = store.save(5, _state()) / STATE_FILE
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x40  # inside the tensor data; the file still parses
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the digest"):
        store.restore(5, _state())


@pytest.mark.parametrize("cut", [0, 4, 100, -1])
def test_a_cut_file_is_unreadable(tmp_path, cut):
    store = CheckpointStore(tmp_path, keep=1)
    file = store.save(5, _state()) / STATE_FILE
    file.write_bytes(file.read_bytes()[:cut])
    with pytest.raises(CheckpointError, match="unreadable"):
        store.restore(5, _state())


def test_a_state_of_another_shape_is_named(tmp_path):
    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, _state())
    wider = _state() | {"params": {"fc": jnp.zeros((3, 5)), "norm": jnp.zeros(4, jnp.bfloat16)}}
    with pytest.raises(CheckpointError, match=r"\['params'\]\['fc'\] is float32\[3, 4\], this run expects float32\[3, 5\]"):
        store.restore(1, wider)
    more = _state() | {"params": {**_state()["params"], "bias": jnp.zeros(4)}}
    with pytest.raises(CheckpointError, match=r"no tensor for \['params'\]\['bias'\]"):
        store.restore(1, more)
    fewer = _state() | {"params": {"fc": jnp.zeros((3, 4))}}
    with pytest.raises(CheckpointError, match=r"no place for: \['params'\]\['norm'\]"):
        store.restore(1, fewer)


def test_a_missing_file_and_set_aside(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", keep=2)
    (store.save(4, _state()) / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match="state.safetensors is missing"):
        store.restore(4, _state())
    aside = store.set_aside(4)
    assert aside.parent == tmp_path / "corrupt_checkpoints" and aside.is_dir() and store.steps() == []
