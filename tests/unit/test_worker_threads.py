"""Each CPU worker process of a host gets an equal share of its cores as torch intra-op threads."""

from mstar.runtime.process import cpu_thread_shares


def test_cpu_workers_share_the_cores_and_gpu_workers_are_left_alone():
    assert cpu_thread_shares(["cpu", "cpu", "cpu"], 16, None) == {0: 5, 1: 5, 2: 5}
    assert cpu_thread_shares(["cuda", "cpu", "cuda", "cpu"], 16, None) == {1: 8, 3: 8}
    assert cpu_thread_shares(["cpu", "cpu", "cpu"], 2, None) == {0: 1, 1: 1, 2: 1}  # at least one each
    assert cpu_thread_shares(["cuda", "cuda"], 16, None) == {}


def test_an_explicit_omp_num_threads_stands():
    assert cpu_thread_shares(["cpu", "cpu"], 16, "3") == {}
    assert cpu_thread_shares(["cpu", "cpu"], 16, "") == {0: 8, 1: 8}  # empty counts as unset
