"""The α-β-γ cost model: formulas, the lecture table, exact bytes, busbw and the α/β fit.

(Whether the implementations really move these bytes is checked against traces in
test_collectives.py; here the formulas are checked against each other and against
first principles.)"""
import math
import random

import pytest
import torch

from minidist import cost


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16])
def test_ring_and_halving_terms_follow_thakur_rabenseifner_gropp(n):
    a, b, g = cost.allreduce_terms("ring", n)
    assert (a, b, g) == (2 * (n - 1), pytest.approx(2 * (n - 1) / n), pytest.approx((n - 1) / n))
    a, b, g = cost.allreduce_terms("recursive_halving", n)
    p = 2 ** int(math.log2(n))
    fold = 0 if p == n else 1
    assert a == 2 * math.log2(p) + 2 * fold
    assert b == pytest.approx(2 * (p - 1) / p + 2 * fold)
    assert g == pytest.approx((p - 1) / p + fold)


def test_one_rank_costs_nothing_and_bad_input_is_rejected():
    for alg in cost.ALLREDUCE_ALGORITHMS:
        assert cost.allreduce_time(alg, 1, 1e6, 1e-5, 1e-9, 1e-10) == 0.0
    with pytest.raises(ValueError, match="unknown all-reduce"):
        cost.allreduce_terms("butterfly", 4)
    with pytest.raises(ValueError, match="ports"):
        cost.allreduce_terms("ring", 4, ports="many")
    with pytest.raises(ValueError, match="positive"):
        cost.allreduce_terms("ring", 0)


def test_time_is_latency_plus_bandwidth_plus_compute():
    n, S, alpha, beta, gamma = 4, 1 << 20, 10e-6, 1e-9, 0.5e-9
    t = cost.allreduce_time("ring", n, S, alpha, beta, gamma)
    assert t == pytest.approx(6 * alpha + 1.5 * S * beta + 0.75 * S * gamma)
    # small messages: halving's lg n latency terms win; the bandwidth terms are identical
    small = [cost.allreduce_time(a, 16, 1024, alpha, beta) for a in ("ring", "recursive_halving")]
    assert small[1] < small[0]
    big = [cost.allreduce_time(a, 16, 1 << 30, 0, beta) for a in ("ring", "recursive_halving")]
    assert big[0] == pytest.approx(big[1])


def test_parameter_server_is_constant_time_only_if_the_server_drives_all_links():
    multi = [cost.allreduce_time("parameter_server", n, 1e6, 0, 1e-9, ports="multi") for n in (2, 8, 32)]
    single = [cost.allreduce_time("parameter_server", n, 1e6, 0, 1e-9, ports="single") for n in (2, 8, 32)]
    assert multi[0] == multi[1] == multi[2]
    assert single[2] / single[1] == pytest.approx(31 / 7)


def _growth(values_small, values_big, ratio, n_small=64):
    """Name the growth of a quantity measured at n_small and ratio·n_small."""
    r = values_big / values_small
    if r <= 1.15:                       # bounded (the ring's 2(N-1)/N·S tends to 2S)
        return "O(1)"
    if r == pytest.approx(math.log2(ratio * n_small) / math.log2(n_small), rel=0.05):
        return "O(log N)"
    if r == pytest.approx(ratio, rel=0.2):
        return "O(N)"
    if r == pytest.approx(ratio ** 2, rel=0.2):
        return "O(N^2)"
    if r == pytest.approx(ratio * math.log2(ratio * n_small) / math.log2(n_small), rel=0.05):
        return "O(N log N)"
    return f"x{r:.2f}"


def test_peak_node_bandwidth_is_the_busiest_nodes_bytes_over_the_whole_all_reduce():
    """One definition everywhere (cost table, deck 01, lab 1): naive moves (N-1)·S through rank 0."""
    rows = {r.algorithm: r for r in cost.allreduce_table(8, 1.0)}
    assert rows["naive"].peak_node_bandwidth == "O(N)" and rows["naive"].peak_node_bytes == 7
    assert rows["ring"].peak_node_bandwidth == "O(1)" and rows["ring"].peak_node_bytes == pytest.approx(14 / 8)
    assert rows["tree"].peak_node_bandwidth == "O(log N)" and rows["tree"].peak_node_bytes == 3
    # recursive doubling swaps whole vectors (lg N·S); Rabenseifner's halving-then-doubling, the ring's bytes
    assert rows["recursive_doubling"].peak_node_bytes == 3
    assert rows["recursive_halving"].peak_node_bytes == pytest.approx(14 / 8)
    assert cost.allreduce_terms("recursive_doubling", 8) == (3, 3, 3)


def test_lecture_table_big_o_agrees_with_its_exact_numbers():
    small, big = cost.allreduce_table(64, 1.0), cost.allreduce_table(1024, 1.0)
    assert [r.algorithm for r in small] == ["parameter_server", "naive", "ring", "parallel", "recursive_doubling",
                                         "recursive_halving", "tree"]
    for s, b in zip(small, big):
        assert _growth(s.peak_node_bytes, b.peak_node_bytes, 16) == s.peak_node_bandwidth, s.algorithm
        assert _growth(s.total_bytes, b.total_bytes, 16) == s.total_bandwidth, s.algorithm
        # time: the bandwidth-free part (α = 1, β = 0) in the lecture's all-links-at-once model
        ts, tb = (cost.allreduce_time(s.algorithm, n, 1.0, 1.0, 0.0, ports="multi") for n in (64, 1024))
        expected = {"O(1)": 1.0, "O(N)": 1023 / 63, "O(log N)": 10 / 6}[s.time]
        assert tb / ts == pytest.approx(expected, rel=0.05), s.algorithm


@pytest.mark.parametrize("numel,n", [(0, 3), (2, 5), (10, 3), (12, 4), (101, 7)])
def test_chunk_sizes_are_tensor_split_sizes(numel, n):
    assert cost.chunk_sizes(numel, n) == [c.numel() for c in torch.arange(numel).tensor_split(n)]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("numel", [1, 7, 64, 1000])
def test_exact_bytes_are_the_nominal_formula_up_to_chunk_rounding(n, numel):
    S = numel * 4
    ring = cost.allreduce_bytes_per_rank("ring", n, numel)
    for sent, recv in ring:
        assert abs(sent - cost.ring_bytes_nominal(n, S)) <= 2 * 4
        assert abs(recv - cost.ring_bytes_nominal(n, S)) <= 2 * 4
    assert sum(s for s, _ in ring) == pytest.approx(cost.total_bytes("ring", n, S), abs=2 * n * 4)
    halving = cost.allreduce_bytes_per_rank("recursive_halving", n, numel)
    assert sum(s for s, _ in halving) == sum(r for _, r in halving)      # every byte sent is received
    if n & (n - 1) == 0 and numel % n == 0:
        assert all(s == r == 2 * (n - 1) * S // n for s, r in halving)
    assert sum(s for s, _ in halving) == pytest.approx(cost.total_bytes("recursive_halving", n, S), abs=4 * n * 4)
    for alg in ("parameter_server", "naive", "parallel", "tree", "recursive_doubling"):
        per_rank = cost.allreduce_bytes_per_rank(alg, n, numel)
        assert sum(s for s, _ in per_rank) == cost.total_bytes(alg, n, S), alg
        assert max(s for s, _ in per_rank) == cost.peak_node_bytes(alg, n, S), alg
    for alg in ("ring", "recursive_halving"):       # exact up to chunk rounding
        per_rank = cost.allreduce_bytes_per_rank(alg, n, numel)
        assert abs(max(s for s, _ in per_rank) - cost.peak_node_bytes(alg, n, S)) <= 4 * 4, alg


def test_busbw_uses_the_nccl_tests_factors():
    assert cost.busbw(1e9, 1.0, 4) == pytest.approx(1.5e9)
    assert cost.busbw(1e9, 1.0, 8, "all_gather") == pytest.approx(7 / 8 * 1e9)
    assert cost.busbw(1e9, 2.0, 8, "broadcast") == pytest.approx(0.5e9)
    assert cost.algbw(1e9, 2.0) == pytest.approx(0.5e9)


def test_fit_recovers_alpha_beta_from_noisy_ring_timings():
    rng = random.Random(0)
    alpha, beta, n = 50e-6, 1 / 2e9, 4
    sizes = [2 ** k for k in range(8, 26, 2)]
    times = [cost.allreduce_time("ring", n, s, alpha, beta) * (1 + 0.03 * rng.uniform(-1, 1)) for s in sizes]
    fit = cost.fit_alpha_beta(sizes, times, "ring", n)
    assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.beta == pytest.approx(beta, rel=0.1)
    assert fit.rel_rms < 0.05
    assert fit.predict(1 << 20) == pytest.approx(cost.allreduce_time("ring", n, 1 << 20, fit.alpha, fit.beta))


def test_joint_fit_over_several_algorithms_and_p2p_fit():
    alpha, beta, n = 20e-6, 1e-9, 8
    algs = ["ring", "recursive_halving", "naive"] * 4
    sizes = [s for s in (1e3, 1e4, 1e5, 1e6) for _ in range(3)]
    times = [cost.allreduce_time(a, n, s, alpha, beta) for a, s in zip(algs, sizes)]
    fit = cost.fit_alpha_beta(sizes, times, algs, n)
    assert (fit.alpha, fit.beta) == (pytest.approx(alpha), pytest.approx(beta))
    p2p = cost.fit_alpha_beta([0, 1e6], [alpha, alpha + 1e6 * beta])
    assert (p2p.alpha, p2p.beta) == (pytest.approx(alpha), pytest.approx(beta))


def test_fit_keeps_alpha_non_negative_and_rejects_bad_points():
    # pure bandwidth data with a little noise would give a slightly negative α unconstrained
    sizes = [1e3, 1e4, 1e5, 1e6]
    times = [s * 1e-9 * f for s, f in zip(sizes, (0.9, 1.0, 1.0, 1.0))]
    fit = cost.fit_alpha_beta(sizes, times, "ring", 4)
    assert fit.alpha >= 0 and fit.beta > 0
    with pytest.raises(ValueError, match="two"):
        cost.fit_alpha_beta([1.0], [1.0])
    with pytest.raises(ValueError, match="> 0"):
        cost.fit_alpha_beta([1.0, 2.0], [0.0, 1.0])


def test_why_distribute_arithmetic_of_the_overview_lecture():
    """GPT-3: 6·P·D = 3.15e23 FLOP (Brown et al. report 3.14e23); 350 GB of fp16 weights
    against an 80 GB GPU; centuries on one V100, decades on one H100, at 40% of peak."""
    flops = cost.training_flops(cost.GPT3_PARAMS, cost.GPT3_TOKENS)
    assert flops == pytest.approx(3.14e23, rel=0.01)
    assert cost.model_bytes(cost.GPT3_PARAMS, 2) == pytest.approx(350e9)
    assert cost.model_bytes(cost.GPT3_PARAMS, cost.zero_bytes_per_param(0, 1)) == pytest.approx(2.8e12)
    assert cost.gpu_years(flops, cost.PEAK_TFLOPS["V100"]) > 100
    assert 10 < cost.gpu_years(flops, cost.PEAK_TFLOPS["H100"]) < 100
    with pytest.raises(ValueError):
        cost.gpu_years(flops, 100, utilisation=0)


def test_overlap_formulas_by_hand():
    """exposed = max(0, comm - overlappable compute), per technique (minidist.cost.overlap)."""
    assert cost.exposed_time(3.0, 1.0) == 2.0 and cost.exposed_time(1.0, 3.0) == 0.0
    # DDP: 4 buckets of 1 s, backward 4 s: ready at 1, 2, 3, 4; the queue ends at 5 -> 1 s exposed;
    # 2 s buckets queue up: 1+2, then 3..5, 5..7, 7..9 -> 5 s past the end of backward
    assert cost.ddp_exposed([1.0] * 4, 4.0) == pytest.approx(1.0)
    assert cost.ddp_exposed([2.0] * 4, 4.0) == pytest.approx(5.0)
    assert cost.ddp_exposed([1.0] * 4, 4.0, overlap=False) == 4.0
    # FSDP: the first gather exposed, each next one beyond the previous unit's compute
    assert cost.prefetch_exposed([2.0, 2.0, 2.0], [1.0, 3.0, 1.0]) == pytest.approx(2.0 + 1.0 + 0.0)
    assert cost.prefetch_exposed([2.0, 2.0, 2.0], [1.0, 3.0, 1.0], prefetch=False) == 6.0
    assert cost.prefetch_extra_bytes([10, 10, 10]) == 10 and cost.prefetch_extra_bytes([4, 1, 8, 2]) == 2
    assert cost.prefetch_extra_bytes([5]) == 0
    # a ring on t = 4: 3 message steps, each behind one chunk's matmul
    assert cost.ring_exposed(2.0, 0.5, 4) == pytest.approx(4.5) and cost.ring_exposed(2.0, 0.5, 4, False) == 6.0
    assert cost.ring_bytes(100, 4) == 300
    cm = cost.collective_matmul(rows=8, d_in=4, d_out=2, t=4, alpha=1.0, beta=0.5, flops=8.0)
    # each step moves 2 rows × 4 features × 4 bytes = 32 bytes: 1 + 16 s; each chunk's matmul 2·2·4·2/8 = 4 s
    assert (cm["step_comm_s"], cm["step_compute_s"]) == (17.0, 4.0)
    assert (cm["exposed_plain_s"], cm["exposed_ring_s"], cm["compute_s"]) == (51.0, 39.0, 16.0)
    with pytest.raises(ValueError, match="do not split"):
        cost.collective_matmul(rows=7, d_in=4, d_out=2, t=4, alpha=1.0, beta=0.5, flops=8.0)
    with pytest.raises(ValueError):
        cost.exposed_time(-1.0, 0.0)
