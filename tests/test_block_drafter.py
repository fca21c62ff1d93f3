"""The block drafter on CPU, tiny random targets: output stays token-identical to official, the features the batched
engine feeds it equal the R-SWA teacher features, its drafts for a batch of rows equal the network's draft of each
row alone, the draft policy's rules, teacher data refuses tokens the target would not choose, and
`scripts/train/drafter.py` runs end to end (loss falls; uflash then loads and uses the drafter)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.batch.engine import BatchEngine
from engine.batch.rows import make_drafters
from engine.drafters.block import BlockDrafterConfig, BlockDrafterNet
from engine.drafters.block_rows import BlockRows
from engine.drafters.block_teacher import TeacherMismatch, label_features, make_examples, teacher_features
from engine.drafters.policy import DraftPolicy
from engine.loading import load_decoder
from engine.model.load import load_model
from engine.model.tiny import build_tiny_model
from engine.official import official_generate
from tests.conftest import text_page

LENGTH = 100  # > 3x the window of 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(build_tiny_model(tmp_path_factory.mktemp("block") / "m", sliding_window=8, seed=0)),
                      "cpu", "float32")


def _net(loaded, context=16, block=6, seed=0, memory=False):
    torch.manual_seed(seed)
    cfg = loaded.model.config.text_config
    config = BlockDrafterConfig(target_hidden=cfg.hidden_size, layers=BlockDrafterConfig.default_layers(
        cfg.num_hidden_layers), block=block, context=context, dim=32, num_layers=1, num_heads=2, memory=memory)
    return BlockDrafterNet(config).eval().requires_grad_(False)


def _decode(loaded, pages, **options):
    """One chunk through a BatchEngine in lossless mode (k_max 6; every step as wide as its draft): (engine, result);
    its tokens must be official's."""
    engine = BatchEngine(loaded, "lossless", k_max=6, adaptive_width=False, **options)
    (res,) = engine.run([engine.prepare(pages, LENGTH)])
    return engine, res


@pytest.mark.parametrize("n_pages,memory", [(1, False), (3, False), (3, True)])
def test_lossless_with_the_block_drafter_is_token_identical_and_fed_the_rswa_features(tiny, n_pages, memory):
    pages = [text_page(i) for i in range(n_pages)]
    kind = "single" if n_pages == 1 else "multi"
    official = official_generate(tiny, pages, kind, LENGTH).output_ids
    vocab = tiny.model.config.text_config.vocab_size
    net = _net(tiny, memory=memory)
    # replay drafts right at two tokens of three: rounds accept 0, 1 or several tokens, so every feed size occurs
    replay = [t if i % 3 else (t + 5) % vocab for i, t in enumerate(official)]
    engine = BatchEngine(tiny, "lossless", k_max=6, drafters=("block", "replay"), block_net=net,
                         block_beside_copies=True, adaptive_width=False)
    (res,) = engine.run([engine.prepare(pages, LENGTH, replay_ids=replay)])
    assert res.output_ids == official
    stats = res.stats["drafters"]
    assert stats["block"]["rounds"] > 0 and stats["replay"]["accepted"] > 0
    assert len(stats["replay"]["acceptance_by_position"]) == 6

    # the drafter's state of row 0 after the chunk: the features of every input but the last emitted token
    block, C = engine.block, net.config.context
    teacher = teacher_features(tiny, pages, official, net.config.layers)
    end = teacher.prompt_len + len(official) - 1
    assert block.fed[0] == end
    in_order = torch.as_tensor((block.fed[0] + np.arange(C)) % C)
    got, want = block.ctx[0, in_order], teacher.features[end - C : end]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    if memory:  # the page memory: the teacher's prompt features projected, padding masked and zero
        P = teacher.prompt_len
        assert block.mem_capacity >= P
        assert block.allowed[0, 0, 0].tolist() == [True] * P + [False] * (block.mem_capacity - P)
        expected = net.encode_memory(teacher.features[None, :P])
        for (k, v), (ek, ev) in zip(block.kv, expected.kv):
            assert torch.allclose(k[0, :, :P], ek[0], atol=1e-4) and torch.allclose(v[0, :, :P], ev[0], atol=1e-4)
            assert not k[0, :, P:].any() and not v[0, :, P:].any()
    else:
        assert block.kv == [] and block.mem_capacity == 0

    def drafter(engine):
        request = SimpleNamespace(kind=kind, reference_texts=None, replay_ids=None)
        (d,) = make_drafters(engine, request, 0)
        return d

    alone, res = _decode(tiny, pages, drafters=("block",), block_net=net)
    assert res.output_ids == official and drafter(alone).sits_out is True
    benched = res.stats["single_steps"]  # a random net misses: the drafter sits out rounds
    eager, res = _decode(tiny, pages, drafters=("block",), block_net=net, block_sits_out=False)
    cut = res.stats  # the block drafter drafts every round, even after a miss; K cut after a miss
    assert res.output_ids == official and drafter(eager).sits_out is False
    assert cut["single_steps"] <= 1 < benched  # 1: no room left for a draft at the end
    full, res = _decode(tiny, pages, drafters=("block",), block_net=net, block_sits_out=False, block_full_k=True)
    stats = res.stats  # every draft as long as the block (or the room left), misses or not
    assert res.output_ids == official and drafter(full).keeps_k is True
    assert len(stats["drafters"]["block"]["acceptance_by_position"]) == 6
    assert stats["draft_tokens"] / stats["verify_rounds"] > 5 > 2 * cut["draft_tokens"] / cut["verify_rounds"]


@pytest.mark.parametrize("memory", [False, True])
def test_the_last_draft_layer_computes_only_the_block_rows_and_gives_what_every_row_gives(memory):
    """The forward runs the last layer on the block rows only (queries; every row stays a key and value): the
    logits equal those of every layer over every row, sliced to the block rows afterwards."""
    torch.manual_seed(0)
    c = BlockDrafterConfig(target_hidden=24, layers=[0, 1], block=5, context=7, dim=32, num_layers=3, num_heads=4,
                           memory=memory)
    net = BlockDrafterNet(c).eval()
    head = torch.nn.Linear(24, 50)
    features, last = torch.randn(2, c.context, 48), torch.randn(2, 24)
    mem = net.encode_memory(torch.randn(2, 11, 48), lengths=[11, 6])
    with torch.no_grad():
        got = net(features, last, head, mem)
        x = torch.cat([net.fuse(features), net.embed_in(last)[:, None], net.mask_token.expand(2, c.block - 1, -1)],
                      dim=1) + net.positions.weight[None]
        for i, layer in enumerate(net.blocks):
            x = layer(x, net.allowed, mem, i)  # every row, every layer
        want = head(net.head_in(net.norm(x[:, c.context:])))
    assert got.shape == (2, c.block, 50) and torch.allclose(got, want, atol=1e-5)

def test_teacher_features_refuse_a_token_the_target_would_not_choose(tiny):
    page = [text_page(0)]
    ids = official_generate(tiny, page, "single", 40).output_ids
    seq = teacher_features(tiny, page, ids, [0, 1])
    assert seq.features.shape == (seq.prompt_len + len(ids), 2 * tiny.model.config.text_config.hidden_size)
    wrong = list(ids)
    wrong[20] = (wrong[20] + 1) % tiny.model.config.text_config.vocab_size
    with pytest.raises(TeacherMismatch, match="output token 20"):
        teacher_features(tiny, page, wrong, [0, 1])


def test_policy_counts_acceptance_by_draft_position():
    class Fixed:
        name = "fixed"

        def propose(self, committed, k):
            return [1] * k

    policy = DraftPolicy([Fixed()], k_max=4)
    assert policy.propose([], 100) == ("fixed", [1] * 4, 0)
    assert DraftPolicy([Fixed()], k_max=4, caps={"fixed": 9}).propose([], 100) == ("fixed", [1] * 9, 0)
    policy.record("fixed", 4, 2)
    policy.record("fixed", 3, 0)
    assert policy.stats["fixed"].as_dict()["acceptance_by_position"] == [0.5, 0.5, 0.0, 0.0]



def test_policy_benches_a_missing_drafter_but_never_the_replay_drafter():
    """A wholly rejected draft benches its drafter for 1, 2, 4 .. rounds; one that declares sits_out = False (the
    replay drafter: free to ask, re-aligns itself) is asked again the very next round, with K cut to 2."""
    from engine.drafters.suffix_match import ReplayDrafter

    class Guess:
        name = "guess"

        def propose(self, committed, k):
            return [7] * k

    replay = ReplayDrafter([5] * 40)
    policy = DraftPolicy([Guess()], k_max=8)
    policy.record("guess", 8, 0)
    assert policy.propose([0], 100) == (None, [], 0)  # benched for one round
    assert policy.propose([0], 100) == ("guess", [7] * 2, 0)
    policy.record("guess", 2, 0)
    assert [policy.propose([0], 100)[0] for _ in range(3)] == [None, None, "guess"]  # two rounds now
    policy = DraftPolicy([replay], k_max=8, caps={"replay": 64})
    assert policy.propose([5], 100) == ("replay", [5] * 39, 0)
    policy.record("replay", 39, 0)
    assert policy.propose([5], 100) == ("replay", [5] * 2, 0)



def test_policy_backs_off_a_drafter_that_proposes_nothing_and_asks_again_now_and_then():
    """A host drafter with nothing to propose (a scan) is asked at rounds 1, 2, 4, 8, 16, then every
    ``MAX_IDLE_BACKOFF + 1`` rounds; a proposal resets it; the replay drafter (sits_out = False) is asked every round."""
    from engine.drafters.policy import MAX_IDLE_BACKOFF
    from engine.drafters.suffix_match import ReplayDrafter

    class Quiet:
        name = "quiet"
        asked = 0
        has = False

        def propose(self, committed, k):
            self.asked += 1
            return [3] * k if self.has else []

    quiet = Quiet()
    policy = DraftPolicy([quiet], k_max=4)
    asked = []
    for round_ in range(100):
        before = quiet.asked
        policy.propose([0], 100)
        if quiet.asked > before:
            asked.append(round_)
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert gaps[:4] == [2, 3, 5, 9] and set(gaps[4:]) == {MAX_IDLE_BACKOFF + 1}
    quiet.has = True
    while policy.propose([0], 100)[0] is None:
        pass
    assert [policy.propose([0], 100)[0] for _ in range(3)] == ["quiet"] * 3  # proposing again: asked every round
    replay = ReplayDrafter([5] * 3)
    policy = DraftPolicy([replay], k_max=8)
    assert [policy.propose([5] * 10, 100) for _ in range(3)] == [(None, [], 0)] * 3
    assert policy._sit_out["replay"] == 0


def leading_matches_sum_to_tau(record: dict) -> bool:
    """The teacher-forced figures of a block drafter: acceptance by position counts leading matches (a position
    counts only when every earlier one matched: never rising), and tau is their sum (the mean accepted length)."""
    by_position = record["acceptance_by_position"]
    return (len(by_position) == 4 and by_position == sorted(by_position, reverse=True)
            and record["tau"] == pytest.approx(sum(by_position), abs=2e-3) and record["examples"] > 0)


@pytest.mark.parametrize("data", [["--data", "labels", "--heldout-pages", "1"], ["--data", "decode", "--no-memory"],
                                  ["--data", "labels", "--multi-frac", "1", "--multi-pages", "2"],
                                  ["--data", "decode", "--multi-frac", "1", "--multi-pages", "2"]])
def test_train_drafter_script_end_to_end_and_uflash_uses_the_result(tmp_path, data):
    from scripts.train.drafter import main

    model = build_tiny_model(tmp_path / "target", sliding_window=8, seed=3, text_init=0.02)
    record_path = tmp_path / "record.json"
    assert main(["--model", str(model), "--device", "cpu", "--dtype", "float32", "--pages", "3", "--steps", "150",
                 "--batch", "32", "--max-new-tokens", "60", "--block", "4", "--dim", "64",
                 "--json", str(record_path), *data]) == 0
    record = json.loads(record_path.read_text())
    assert record["loss_last"] < 0.8 * record["loss_first"], record
    assert record["data"] == data[1] and record["memory"] == ("--no-memory" not in data)
    if "--multi-frac" in data:  # multi-page chunks: fewer sequences than pages, each with separators
        assert record["sequences"] < record["pages"] == 3
    elif data[1] == "labels":
        assert leading_matches_sum_to_tau(record["heldout"])
    assert (model / "drafter" / "drafter_config.json").is_file()

    decoder = load_decoder(str(model), "cpu", "float32", mode="lossless")
    assert decoder.engine.block is not None and "block" in decoder.describe()["drafters"]
    page = [text_page(1)]
    official = official_generate(decoder.loaded, page, "single", 80).output_ids
    out = decoder.decode(page, context_limit=32768, max_new_tokens=80)
    assert out.output_ids == official
    assert "block" in out.chunk_stats["drafters"]
    assert load_decoder(str(model), "cpu", "float32", mode="plain").engine.block is None


@pytest.mark.parametrize("memory", [False, True])
def test_block_rows_draft_for_every_row_what_the_network_drafts_for_it_alone(tiny, memory):
    """`BlockRows` keeps each row's context in a ring and its page memory padded to a bucket: one draft for three
    rows (prompts of 70, 128 and 20 inputs; rounds that commit different counts per row, 1 to 40; a row that
    starts a new chunk half-way) equals the network's draft of each row alone, from its last C fed features and
    its own prompt's memory."""
    net = _net(tiny, context=16, block=6, memory=memory)
    model = tiny.model
    embed, head = model.get_input_embeddings(), model.lm_head
    rows = BlockRows(net, embed, head, max_batch=3, memory_bucket=64)
    C, width = net.config.context, len(net.config.layers) * model.config.text_config.hidden_size
    gen = torch.Generator().manual_seed(3)
    fed, committed = [], []

    def start(row: int, prompt_len: int) -> None:
        features = torch.randn(prompt_len, width, generator=gen)
        rows.start(row, features)
        if row < len(fed):
            fed[row], committed[row] = [features], [5 + row]
        else:
            fed.append([features])
            committed.append([5 + row])

    for row, prompt_len in enumerate((70, 128, 20)):
        start(row, prompt_len)
    for turn, counts in enumerate([(1, 2, 5), (40, 1, 3), (2, 2, 2), (1, 7, 1)]):
        if turn == 2:
            start(1, 40)  # a new chunk in row 1: its ring and memory forget the previous one
        features = torch.randn(3, max(counts), width, generator=gen)
        rows.feed(dict(enumerate(counts)), features)
        for row, count in enumerate(counts):
            fed[row].append(features[row, :count])
            committed[row] += [(7 * len(committed[row]) + row) % 50 + 1 for _ in range(count)]
        assert all(rows.ready(row, committed[row]) for row in range(3))
        got = rows.draft(3, np.array([c[-1] for c in committed])).tolist()
        for row in range(3):
            context = torch.cat(fed[row])[-C:]
            memory = net.encode_memory(fed[row][0][None])
            with torch.inference_mode():
                logits = net(context[None], embed(torch.tensor([committed[row][-1]])), head, memory)
            assert got[row] == logits[0].argmax(-1).tolist(), (turn, row)
    assert rows.mem_capacity == (128 if memory else 0)
    with pytest.raises(RuntimeError, match="fed"):
        rows.ready(0, committed[0] + [1])  # an output the drafter was not fed


def test_label_data_follows_the_greedy_chain_and_cuts_blocks_where_the_label_leaves_it(tiny):
    page = [text_page(0)]
    ids = official_generate(tiny, page, "single", 60).output_ids
    layers = [0, 1]
    same = label_features(tiny, page, ids, layers)  # the target's own output as the "label": all greedy
    assert same.next_ids[:-1] == ids[1:]
    assert torch.allclose(same.features, teacher_features(tiny, page, ids, layers).features, atol=1e-5)

    wrong = list(ids)
    vocab = tiny.model.config.text_config.vocab_size
    wrong[30] = (wrong[30] + 1) % vocab  # the label leaves the greedy path at o_30
    seq = label_features(tiny, page, wrong, layers)
    assert seq.next_ids[29] == ids[30] != wrong[30]
    embed = tiny.model.get_input_embeddings()
    _, _, targets = make_examples([seq], [(0, 26)], 8, 6, embed)
    # anchor 26 drafts o_27 .. o_32: o_27 .. o_30 are the target's (o_30 its own choice, not the label's), then cut
    assert targets[0].tolist() == ids[27:31] + [-100, -100]


def test_teacher_greedy_reads_a_row_again_only_when_the_ban_hits_its_argmax():
    from engine.drafters.block_teacher import _greedy

    row = torch.tensor([0.1, 3.0, 3.0, 2.0])  # ties: the first maximum, as generate() takes it
    assert _greedy(int(row.argmax()), row, set()) == 1
    assert _greedy(int(row.argmax()), row, {2, 3}) == 1  # bans elsewhere leave the first maximum alone
    assert _greedy(int(row.argmax()), row, {1}) == 2  # the argmax banned: the next best, first on ties
    assert _greedy(int(row.argmax()), row, {1, 2}) == 3


def test_policy_skips_a_capped_drafter_that_could_not_win_the_round():
    class Copy:
        name = "copy"

        def __init__(self):
            self.length = 0

        def propose(self, committed, k):
            return [1] * min(k, self.length)

    class Costly:
        name = "block"
        max_draft = 4

        def __init__(self):
            self.asked = 0

        def propose(self, committed, k):
            self.asked += 1
            return [2] * min(k, self.max_draft)

    class OnDevice(Costly):
        """The block drafter of the batched engine: it is asked only whether it can draft; the engine drafts."""

        on_device = True

        def ready(self, committed):
            self.asked += 1
            return True

    for costly in (Costly(), OnDevice()):
        copy = Copy()
        drafted = ([], 4) if isinstance(costly, OnDevice) else ([2] * 4, 0)
        policy = DraftPolicy([copy, costly], k_max=16)
        copy.length = 6  # longer than the block could ever be: its forward is skipped
        assert policy.propose([0], 16) == ("copy", [1] * 6, 0) and costly.asked == 0
        copy.length = 4  # as long as its cap: a tie goes to the first anyway
        assert policy.propose([0], 16) == ("copy", [1] * 4, 0) and costly.asked == 0
        copy.length = 3
        assert policy.propose([0], 16) == ("block", *drafted) and costly.asked == 1
        assert policy.propose([0], 2) == ("copy", [1] * 2, 0) and costly.asked == 1  # room 2: the copy's 2 do


def test_chunks_with_a_full_copy_source_decode_without_the_block_drafter(tiny):
    """Default: a text layer on every page (or replay ids) leaves the block network out; a chunk with a page
    that has nothing to copy keeps it."""
    net = _net(tiny)

    def names(engine, texts=None, replay=None):
        request = SimpleNamespace(kind="multi", reference_texts=texts, replay_ids=replay)
        return [d.name for d in make_drafters(engine, request, 0)]

    default = BatchEngine(tiny, "lossless", block_net=net)
    assert "block" not in names(default, ["page one text", "page two text"])
    assert "block" not in names(default, None, [1, 2, 3])
    assert "block" in names(default, ["page one text", "  "]) and "block" in names(default)
    both = BatchEngine(tiny, "lossless", block_net=net, block_beside_copies=True)
    assert "block" in names(both, ["page one text"])


def test_train_drafter_decodes_with_the_init_drafter_and_live_checks_after_a_warmup(tmp_path, monkeypatch, equal_step_costs):
    """`--data decode --init D` decodes the teacher pages with `lossless` + D in one batch (same tokens, or the
    teacher forward would refuse them); `--eval-only` live-checks a drafter after one untimed warm-up chunk on both
    sides, each chunk alone and (`--eval-batch`) all in one batch. Each timed decode is given a known time (plain 3 s,
    lossless 2 s), so the record's times and speed-up are checked against figures the test knows."""
    from scripts.train import drafter_live_check
    from scripts.train.drafter import main

    real_timed_run = drafter_live_check._timed_run

    def timed_run(engine, chunks, max_new_tokens):
        results, _seconds = real_timed_run(engine, chunks, max_new_tokens)
        return results, {"plain": 3.0, "lossless": 2.0}[engine.mode]

    monkeypatch.setattr(drafter_live_check, "_timed_run", timed_run)

    model = build_tiny_model(tmp_path / "target", sliding_window=8, seed=3, text_init=0.02)
    common = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "50"]
    first, second = tmp_path / "d1", tmp_path / "d2"
    assert main([*common, "--pages", "2", "--steps", "20", "--batch", "16", "--block", "4", "--dim", "64",
                 "--data", "labels", "--out", str(first)]) == 0
    record_path = tmp_path / "record.json"
    assert main([*common, "--pages", "2", "--steps", "5", "--batch", "16", "--data", "decode", "--init", str(first),
                 "--out", str(second), "--json", str(record_path)]) == 0
    decoded = json.loads(record_path.read_text())
    assert (decoded["sequences"], decoded["tokens"]) == (2, 2 * 50)  # the teacher holds the 2 pages as decoded
    assert main([*common, "--eval-only", "--init", str(second), "--eval-pages", "2", "--decoded-heldout-pages", "2",
                 "--json", str(record_path)]) == 0
    record = json.loads(record_path.read_text())
    assert record["decoded_heldout"]["pages"] == 2 and record["decoded_heldout"]["tokens"] == 2 * 50
    assert leading_matches_sum_to_tau(record["decoded_heldout"])
    ev = record["eval"]
    assert ev["identical"] == ev["chunks"] == 2 and ev["warmup_chunks"] == 1
    assert ev["warmup_s"] == {"plain": 3.0, "block": 2.0}  # the one warm-up chunk, kept apart from the timed ones
    assert ev["batch"] == 1 and ev["backend"] == "eager" and ev["tokens"] == 2 * 50  # each chunk to its limit
    assert (ev["plain_s"], ev["block_s"], ev["speedup_vs_plain"]) == (6.0, 4.0, 1.5)  # two chunks, each alone
    assert (ev["plain_tok_s"], ev["block_tok_s"]) == (round(100 / 6.0, 1), 100 / 4.0)  # tokens a second
    # the timed chunks verify block drafts only while the width policy expects them to pay, and after the warm-up it
    # knows this barely trained drafter's record (every step costs it the same here: equal_step_costs, so the shapes
    # do not depend on the machine's load). Its positions: those of the narrower widths it climbs through or probes
    # with, or k_max.
    assert len(ev["acceptance_by_position"]) <= 4 and any(w.endswith("+block") for w in ev["ms_step_by_width"])
    assert main([*common, "--eval-only", "--init", str(second), "--eval-pages", "3", "--eval-batch",
                 "--no-eval-warmup", "--json", str(record_path)]) == 0
    ev = json.loads(record_path.read_text())["eval"]
    assert ev["identical"] == ev["chunks"] == ev["batch"] == 3 and ev["warmup_chunks"] == 0
    assert ev["warmup_s"] == {"plain": 0.0, "block": 0.0}
    assert (ev["plain_s"], ev["block_s"], ev["speedup_vs_plain"]) == (3.0, 2.0, 1.5)  # one batch a side
    # no warm-up: the width policy has measured no step yet, runs width 1 first (the baseline), then climbs to the wider
    # widths, whose steps verify block drafts: at least the positions of width 4 (3 drafts), at most k_max
    assert 3 <= len(ev["acceptance_by_position"]) <= 4 and ev["draft_share"] > 0
    assert any(w.endswith("x4@128+block") for w in ev["ms_step_by_width"])
