from pathlib import Path

from ingest.intake.chunk_plan import ChunkBudget, model_tokens_per_page, plan_document_chunks
from tests.conftest import ROOT


def test_every_page_once_in_order_under_budget():
    budget = ChunkBudget(tokens_per_page=273, context_limit=8192, margin=0.1, max_pages=16)
    est = [300, 2000, 50, 4000, 100, 100, 7000, 10, 10]
    ranges = plan_document_chunks(est, budget)
    assert ranges == [(1, 3), (4, 6), (7, 7), (8, 9)]
    assert [p for a, b in ranges for p in range(a, b + 1)] == list(range(1, len(est) + 1))
    for a, b in ranges:
        cost = budget.prompt_tokens + sum(budget.page_cost(e) for e in est[a - 1 : b])
        assert cost <= budget.budget or a == b


def test_page_cap_and_empty():
    assert plan_document_chunks([10] * 5, ChunkBudget(273, max_pages=2)) == [(1, 2), (3, 4), (5, 5)]
    assert plan_document_chunks([], ChunkBudget(273)) == []
    assert plan_document_chunks([10**6], ChunkBudget(273)) == [(1, 1)]  # too big alone: still its own chunk


def test_the_page_cost_is_the_models_own(tiny_model_dir):
    """The vision tokens a page costs are read from the model folder, equal to what the loaded model says; a model of
    fewer tokens a page fits more pages under the same budget."""
    from engine.model.load import load_model

    assert model_tokens_per_page(str(tiny_model_dir)) == load_model(str(tiny_model_dir), "cpu").tokens_per_page == 21
    assert model_tokens_per_page(str(ROOT / "models" / "demo")) == 273
    assert model_tokens_per_page(str(Path("/no/such/model"))) is None
    est = [100] * 12
    assert plan_document_chunks(est, ChunkBudget(273, context_limit=1200, margin=0.0)) == \
        [(1, 3), (4, 6), (7, 9), (10, 12)]
    assert plan_document_chunks(est, ChunkBudget(21, context_limit=1200, margin=0.0)) == [(1, 9), (10, 12)]
