"""The static fusion plan: bucket boundaries, dtype separation and the plan hash."""

from __future__ import annotations

from tnt_notebook import _native

F32, F64, I32 = (_native.DTYPES[n] for n in ("float32", "float64", "int32"))


def plan(specs, threshold):
    return _native.fusion_plan(specs, threshold)


def test_threshold_zero_puts_every_tensor_in_its_own_bucket() -> None:
    buckets, _ = plan([((10,), F32)] * 5, 0)
    assert buckets == [[0], [1], [2], [3], [4]]


def test_buckets_close_once_they_reach_the_threshold() -> None:
    # 40-byte tensors, threshold 100: a bucket takes tensors until it holds >= 100 bytes
    buckets, _ = plan([((10,), F32)] * 7, 100)
    assert buckets == [[0, 1, 2], [3, 4, 5], [6]]


def test_buckets_never_mix_dtypes_and_keep_plan_order() -> None:
    specs = [((4,), F32), ((4,), F32), ((4,), F64), ((4,), F32), ((2, 2), I32)]
    buckets, _ = plan(specs, 1 << 20)
    assert buckets == [[0, 1], [2], [3], [4]]
    assert [i for b in buckets for i in b] == list(range(len(specs)))


def test_a_tensor_larger_than_the_threshold_gets_a_bucket_of_its_own() -> None:
    buckets, _ = plan([((1,), F32), ((100000,), F32), ((1,), F32)], 32768)
    assert buckets == [[0, 1], [2]]


def test_empty_plan_and_zero_sized_tensors() -> None:
    assert plan([], 32768)[0] == []
    assert plan([((0,), F32), ((0, 3), F32)], 32768)[0] == [[0, 1]]


def test_plan_hash_depends_on_shapes_dtypes_and_threshold() -> None:
    base = [((3, 4), F32), ((5,), F32)]
    h = plan(base, 32768)[1]
    assert plan(list(base), 32768)[1] == h
    assert plan([((4, 3), F32), ((5,), F32)], 32768)[1] != h
    assert plan([((3, 4), F64), ((5,), F32)], 32768)[1] != h
    # a dtype of the same size: the same buckets, still another plan
    same_buckets = plan([((3, 4), I32), ((5,), I32)], 32768)
    assert same_buckets[0] == plan(base, 32768)[0] and same_buckets[1] != h
    assert plan(base, 0)[1] != h
    assert plan(base[:1], 32768)[1] != h


def test_the_version_is_written_once_and_carried_by_the_package_and_the_native_module():
    import importlib.metadata

    import tnt_notebook

    assert _native.__version__ == tnt_notebook.__version__
    assert importlib.metadata.version("tnt_notebook") == tnt_notebook.__version__
