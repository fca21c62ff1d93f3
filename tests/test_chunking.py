from engine.chunking import ChunkPlan, plan_chunks


def test_every_page_once_in_order_under_budget():
    plan = ChunkPlan(context_limit=8192, margin=0.1, max_pages=16)
    est = [300, 2000, 50, 4000, 100, 100, 7000, 10, 10]
    ranges = plan_chunks(est, plan)
    assert [p for a, b in ranges for p in range(a, b + 1)] == list(range(1, len(est) + 1))
    for a, b in ranges:
        cost = plan.prompt_tokens + sum(plan.page_cost(e) for e in est[a - 1 : b])
        assert cost <= plan.budget or a == b


def test_page_cap_and_empty():
    assert plan_chunks([10] * 5, ChunkPlan(max_pages=2)) == [(1, 2), (3, 4), (5, 5)]
    assert plan_chunks([], ChunkPlan()) == []
    assert plan_chunks([10**6], ChunkPlan()) == [(1, 1)]  # too big alone: still its own chunk
