"""Each CPU worker process of a host gets an equal share of its cores as torch intra-op threads; each GPU
worker process one (its idle OpenMP threads would spin on the cores the server needs)."""

from mstar.runtime.process import cpu_thread_shares


def test_cpu_workers_share_the_cores_and_gpu_workers_run_one_thread():
    assert cpu_thread_shares(["cpu", "cpu", "cpu"], 16, None) == {0: 5, 1: 5, 2: 5}
    assert cpu_thread_shares(["cuda", "cpu", "cuda", "cpu"], 16, None) == {0: 1, 1: 8, 2: 1, 3: 8}
    assert cpu_thread_shares(["cpu", "cpu", "cpu"], 2, None) == {0: 1, 1: 1, 2: 1}  # at least one each
    assert cpu_thread_shares(["cuda", "cuda"], 16, None) == {0: 1, 1: 1}


def test_an_explicit_omp_num_threads_stands():
    assert cpu_thread_shares(["cpu", "cpu"], 16, "3") == {}
    assert cpu_thread_shares(["cuda", "cuda"], 16, "4") == {}
    assert cpu_thread_shares(["cpu", "cpu"], 16, "") == {0: 8, 1: 8}  # empty counts as unset
