"""`segment` on a machine of several GPUs, as far as a CPU can show it: a local Ray that believes it has GPUs
(`num_gpus=N`) gets one model actor per GPU from the engine's own pool (`engine.on_model_actors`), and each actor
holds a GPU of its own, so a CUDA package would load once per GPU. Nothing here needs a model: the actors report
where Ray placed them."""

import os
import sys

import pytest

GPUS = 2  # the fake GPUs of the test's Ray


class WhereAmI:
    """A stand-in for `worker.Segmenter`: one row per image, naming the actor's process and the GPUs Ray gave it."""

    def __init__(self, pause: float):
        import ray

        self.pause, self.gpus = pause, [str(g) for g in ray.get_gpu_ids()]
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.threads = os.environ.get("OMP_NUM_THREADS", "")  # Ray gives an actor as many as it holds CPUs

    def __call__(self, batch) -> dict:  # the decoded batch as an Arrow table, as the pool hands it to Segmenter
        import time

        time.sleep(self.pause)  # long enough that the pool hands every actor batches
        sources = batch.column("source").to_pylist()
        return {"source": sources, "pid": [os.getpid()] * len(sources), "gpus": [",".join(self.gpus)] * len(sources),
                "visible": [self.visible] * len(sources), "threads": [self.threads] * len(sources)}


@pytest.mark.slow  # a local Ray
def test_a_cuda_package_gets_one_actor_per_gpu_each_on_its_own_gpu(monkeypatch):
    import shutil
    import tempfile

    import ray

    from sam3_aoti.batch.engine import on_model_actors

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module
    ray_tmp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's sockets live there
    # as the engine does for a Ray it starts (Ray read the switch when it was imported)
    monkeypatch.setattr(ray._private.ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", False)
    ray.init(num_cpus=GPUS + 1, num_gpus=GPUS, include_dashboard=False, log_to_driver=False, _temp_dir=ray_tmp)
    try:
        context = ray.data.DataContext.get_current()
        monkeypatch.setattr(context, "enable_progress_bars", False)
        # every actor up before the first batch: each gets work, however busy the machine
        monkeypatch.setattr(context, "wait_for_min_actors_s", 300)
        decoded = ray.data.from_items([{"source": f"image-{i}"} for i in range(8 * GPUS)])
        found, actors, actor_cpus = on_model_actors(ray, decoded, WhereAmI, {"pause": 0.3}, "cuda", None, 2)
        rows = found.take_all()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert actors == GPUS and sorted(r["source"] for r in rows) == sorted(f"image-{i}" for i in range(8 * GPUS))
    assert actor_cpus == 1 and {r["threads"] for r in rows} == {"1"}  # 3 CPUs: a quarter per actor is under one
    placed = {r["pid"]: (r["gpus"], r["visible"]) for r in rows}
    assert len(placed) == GPUS, placed  # every actor of the pool did work
    assert sorted(g for g, _ in placed.values()) == [str(i) for i in range(GPUS)], placed  # a GPU each, none twice
    assert all(g == visible for g, visible in placed.values()), placed  # what torch's "cuda" would be


class DiesOnce(WhereAmI):
    """A stand-in whose actor on the last GPU ends its process at its first batch, once (a marker file says so):
    what a GPU fault or a kill does to a model actor."""

    def __init__(self, pause: float, marker: str):
        super().__init__(pause)
        self.marker = marker

    def __call__(self, batch) -> dict:
        if self.gpus == [str(GPUS - 1)] and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return super().__call__(batch)


@pytest.mark.slow  # a local Ray
def test_a_killed_actor_is_restarted_on_its_gpu_and_every_image_comes_back_once(monkeypatch, tmp_path):
    """The engine's GPU pool, as segment runs it, on a Ray with fake GPUs: the actor of one GPU dies mid-run; Ray
    starts another on that GPU, its batch runs again, and each image's row comes back once (the dataset's own
    exactly-once is the driver's: tests/test_segment.py kills a CPU actor under the real Segmenter)."""
    import shutil
    import tempfile

    import ray

    from sam3_aoti.batch.engine import on_model_actors

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray_tmp = tempfile.mkdtemp(prefix="ray-")
    monkeypatch.setattr(ray._private.ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", False)
    ray.init(num_cpus=GPUS + 1, num_gpus=GPUS, include_dashboard=False, log_to_driver=False, _temp_dir=ray_tmp)
    marker = tmp_path / "died"
    try:
        context = ray.data.DataContext.get_current()
        monkeypatch.setattr(context, "enable_progress_bars", False)
        monkeypatch.setattr(context, "wait_for_min_actors_s", 300)
        decoded = ray.data.from_items([{"source": f"image-{i}"} for i in range(8 * GPUS)])
        found, *_ = on_model_actors(ray, decoded, DiesOnce, {"pause": 0.3, "marker": str(marker)}, "cuda", None, 2)
        rows = found.take_all()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert marker.exists()  # an actor died
    assert sorted(r["source"] for r in rows) == sorted(f"image-{i}" for i in range(8 * GPUS))  # each once
    on_last = {r["pid"] for r in rows if r["gpus"] == str(GPUS - 1)}
    assert on_last, rows  # the last GPU's work was done, by the actor Ray started in the dead one's place
    assert all(r["gpus"] == r["visible"] for r in rows)


def test_a_cuda_package_on_a_ray_without_gpus_is_one_line():
    from sam3_aoti.batch.engine import on_model_actors
    from sam3_aoti.errors import ConfigError

    class NoGpuRay:
        @staticmethod
        def cluster_resources():
            return {"CPU": 4.0}

    with pytest.raises(ConfigError, match="has no GPU"):
        on_model_actors(NoGpuRay, None, WhereAmI, {}, "cuda", None, 2)


def test_actors_holding_every_cpu_are_one_line_and_each_holds_a_quarter_by_default():
    """The CPUs a GPU actor holds (Ray starts it with as many OpenMP threads, and the decoding takes the rest):
    a quarter of the cluster's per actor by default, at most GPU_ACTOR_CPUS; asked for all of them, one line."""
    import types

    from sam3_aoti.batch.engine import GPU_ACTOR_CPUS, on_model_actors
    from sam3_aoti.errors import ConfigError

    def cluster(cpus: int, gpus: int):  # the little of Ray the pool's set-up reads
        return types.SimpleNamespace(__version__="fake", cluster_resources=lambda: {"CPU": cpus, "GPU": gpus},
                                     data=types.SimpleNamespace(ActorPoolStrategy=lambda **kw: kw))

    class Decoded:
        def map_batches(self, *args, num_cpus, **kwargs):
            return num_cpus  # what each actor holds

    with pytest.raises(ConfigError, match="leave none of the cluster's 8 for the decoding: give --actor-cpus fewer"):
        on_model_actors(cluster(8, 2), Decoded(), WhereAmI, {}, "cuda", None, 2, actor_cpus=4)
    assert on_model_actors(cluster(8, 2), Decoded(), WhereAmI, {}, "cuda", None, 2) == (1, 2, 1)
    assert on_model_actors(cluster(64, 1), Decoded(), WhereAmI, {}, "cuda", None, 2) == (GPU_ACTOR_CPUS, 1,
                                                                                           GPU_ACTOR_CPUS)
    assert on_model_actors(cluster(64, 1), Decoded(), WhereAmI, {}, "cuda", None, 2, actor_cpus=2)[0] == 2
    assert on_model_actors(cluster(64, 0), Decoded(), WhereAmI, {}, "cpu", None, 2, actor_cpus=8)[0] == 1
