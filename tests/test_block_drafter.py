"""The block drafter (issue 7) on CPU, tiny random targets: output stays token-identical to official, the features
it is fed online equal the R-SWA teacher features, teacher data refuses tokens the target would not choose, and
`scripts/train_drafter.py` runs end to end (loss falls; uflash then loads and uses the drafter)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.chunk_decode import load_decoder
from engine.drafters.block import BlockDrafter, BlockDrafterConfig, BlockDrafterNet
from engine.drafters.block_static import StaticBlockDrafter
from engine.drafters.block_teacher import TeacherMismatch, label_features, make_examples, teacher_features
from engine.drafters.policy import DraftPolicy
from engine.model import load_model
from engine.official import official_generate
from engine.speculative import SpeculativeDecoder
from engine.tiny import build_tiny_model
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


class Recording(SpeculativeDecoder):
    """Keeps the drafters of its last decode (to look at the block drafter's state afterwards)."""

    def _drafters(self, kind, reference_texts, replay_ids):
        self.last_drafters = super()._drafters(kind, reference_texts, replay_ids)
        return self.last_drafters


def _assert_memory_is_the_prompt(block, net, teacher):
    """The page memory the drafter read equals the memory of the teacher's prompt features."""
    if not net.config.memory:
        assert block._memory is None
        return
    expected = net.encode_memory(teacher.features[None, : teacher.prompt_len])
    for (k, v), (ek, ev) in zip(block._memory.kv, expected.kv):
        assert torch.allclose(k, ek, atol=1e-4) and torch.allclose(v, ev, atol=1e-4)


@pytest.mark.parametrize("n_pages,memory", [(1, False), (3, False), (3, True)])
def test_lossless_with_the_block_drafter_is_token_identical_and_fed_the_rswa_features(tiny, n_pages, memory):
    pages = [text_page(i) for i in range(n_pages)]
    kind = "single" if n_pages == 1 else "multi"
    official = official_generate(tiny, pages, kind, LENGTH).output_ids
    vocab = tiny.model.config.text_config.vocab_size
    net = _net(tiny, memory=memory)
    # replay drafts right at every other token: rounds accept 0, 1 or several tokens, so every feed size occurs
    replay = [t if i % 3 else (t + 5) % vocab for i, t in enumerate(official)]
    dec = Recording(tiny, mode="lossless", k_max=6, drafters=("block", "replay"), block_net=net,
                    block_beside_copies=True, replay_k_max=6)
    res = dec.generate(pages, LENGTH, replay_ids=replay)
    assert res.output_ids == official
    stats = res.extra["speculative"]["drafters"]
    assert stats["block"]["rounds"] > 0 and stats["replay"]["accepted"] > 0
    assert len(stats["replay"]["acceptance_by_position"]) == 6

    block = next(d for d in dec.last_drafters if isinstance(d, BlockDrafter))
    teacher = teacher_features(tiny, pages, official, net.config.layers)
    end = teacher.prompt_len + len(official) - 1  # every input but the last emitted token
    assert block.fed == end
    expected = teacher.features[end - net.config.context : end]
    assert torch.allclose(block._buffer, expected, atol=1e-4), (block._buffer - expected).abs().max()
    _assert_memory_is_the_prompt(block, net, teacher)

    alone = SpeculativeDecoder(tiny, mode="lossless", k_max=6, drafters=("block",), block_net=net)
    assert alone.generate(pages, LENGTH).output_ids == official
    eager = Recording(tiny, mode="lossless", k_max=6, drafters=("block",), block_net=net, block_sits_out=False)
    res = eager.generate(pages, LENGTH)  # the block drafter drafts every round, even after a miss
    benched = alone.generate(pages, LENGTH).extra["speculative"]["single_steps"]  # a random net misses: benched
    assert res.output_ids == official and res.extra["speculative"]["single_steps"] <= 1 < benched  # 1: no room left
    assert eager.last_drafters[0].sits_out is False and alone._drafters(kind, None, None)[0].sits_out is True
    full = Recording(tiny, mode="lossless", k_max=6, drafters=("block",), block_net=net, block_sits_out=False,
                     block_full_k=True)
    res = full.generate(pages, LENGTH)  # every draft as long as the block (or the room left), misses or not
    by_position = res.extra["speculative"]["drafters"]["block"]["acceptance_by_position"]
    stats = res.extra["speculative"]
    assert res.output_ids == official and full.last_drafters[0].keeps_k is True and len(by_position) == 6
    cut = eager.generate(pages, LENGTH).extra["speculative"]  # K cut after a miss (a random net misses)
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
    assert policy.propose([], 100) == ("fixed", [1] * 4)
    assert DraftPolicy([Fixed()], k_max=4, caps={"fixed": 9}).propose([], 100) == ("fixed", [1] * 9)
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
    assert policy.propose([0], 100) == (None, [])  # benched for one round
    assert policy.propose([0], 100) == ("guess", [7] * 2)
    policy.record("guess", 2, 0)
    assert [policy.propose([0], 100)[0] for _ in range(3)] == [None, None, "guess"]  # two rounds now
    policy = DraftPolicy([replay], k_max=8, caps={"replay": 64})
    assert policy.propose([5], 100) == ("replay", [5] * 39)
    policy.record("replay", 39, 0)
    assert policy.propose([5], 100) == ("replay", [5] * 2)

@pytest.mark.parametrize("data", [["--data", "labels", "--heldout-pages", "1"], ["--data", "decode", "--no-memory"],
                                  ["--data", "labels", "--multi-frac", "1", "--multi-pages", "2"],
                                  ["--data", "decode", "--multi-frac", "1", "--multi-pages", "2"]])
def test_train_drafter_script_end_to_end_and_uflash_uses_the_result(tmp_path, data):
    from scripts.train_drafter import main

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
        assert 0 <= record["heldout"]["tau"] <= 4 and len(record["heldout"]["acceptance_by_position"]) == 4
    assert (model / "drafter" / "drafter_config.json").is_file()

    decoder = load_decoder(str(model), "cpu", "float32", mode="lossless")
    assert decoder.block_net is not None and "block" in decoder.describe()["drafters"]
    page = [text_page(1)]
    official = official_generate(decoder.loaded, page, "single", 80).output_ids
    res = decoder.generate(page, 80)
    assert res.output_ids == official
    assert "block" in res.extra["speculative"]["drafters"]
    assert load_decoder(str(model), "cpu", "float32", mode="plain").block_net is None


def test_the_static_runner_feeds_the_block_drafter_the_same_features(tiny):
    """FastDecoder's static path (the CUDA-graph body, run eagerly on the CPU) with the block drafter: same tokens
    as official, and the same fed features (and page memory) as the R-SWA teacher."""
    from engine.fast_decoder import FastDecoder

    pages = [text_page(i) for i in range(3)]
    official = official_generate(tiny, pages, "multi", LENGTH).output_ids
    net = _net(tiny, memory=True)
    vocab = tiny.model.config.text_config.vocab_size
    replay = [t if i % 3 else (t + 5) % vocab for i, t in enumerate(official)]
    seen = {}

    class RecordingFast(FastDecoder):
        def _drafters(self, kind, reference_texts, replay_ids):
            seen["drafters"] = super()._drafters(kind, reference_texts, replay_ids)
            return seen["drafters"]

    dec = RecordingFast(tiny, mode="lossless", k_max=6, drafters=("block", "replay"), block_net=net,
                        backend="static", block_beside_copies=True)
    res = dec.generate(pages, LENGTH, replay_ids=replay)
    assert res.extra["speculative"]["backend"] == "static"
    assert res.output_ids == official
    assert res.extra["speculative"]["drafters"]["block"]["rounds"] > 0
    block = next(d for d in seen["drafters"] if d.name == "block")
    assert isinstance(block, StaticBlockDrafter)  # the static path drafts from static buffers
    teacher = teacher_features(tiny, pages, official, net.config.layers)
    end = teacher.prompt_len + len(official) - 1
    assert block.fed == end
    assert torch.allclose(block.ctx[0], teacher.features[end - net.config.context : end], atol=1e-4)
    P = teacher.prompt_len
    memory = block._memory[block.bucket]
    assert block.bucket >= P and memory.allowed[0, 0, 0].tolist() == [True] * P + [False] * (block.bucket - P)
    expected = net.encode_memory(teacher.features[None, :P])
    for (k, v), (ek, ev) in zip(memory.kv, expected.kv):
        assert torch.allclose(k[:, :, :P], ek, atol=1e-4) and torch.allclose(v[:, :, :P], ev, atol=1e-4)
        assert not k[:, :, P:].any() and not v[:, :, P:].any()


@pytest.mark.parametrize("mode", ["lossless", "fast"])
def test_drafts_kept_on_the_device_decode_and_count_what_host_drafts_do(tiny, mode):
    """The fast path's block drafts stay on the device (`DeviceDraft`; the verify step stages them by a device copy
    and names them in its rows): the same tokens (official's, in lossless), the same rounds, acceptance and
    log-probabilities as drafts read on the host first."""
    from engine.drafters import DeviceDraft
    from engine.fast_decoder import FastDecoder

    pages = [text_page(i) for i in range(3)]
    net = _net(tiny, memory=True)
    results, kinds = {}, {}
    for device_drafts in (True, False):
        dec = FastDecoder(tiny, mode=mode, k_max=6, drafters=("block",), block_net=net, backend="static",
                          device_drafts=device_drafts, block_sits_out=False, fast_threshold=1e-4)
        drafter = dec.static_block
        plain_propose = drafter.propose
        seen = kinds[device_drafts] = set()

        def spy(committed, k, propose=plain_propose, seen=seen):
            draft = propose(committed, k)
            seen.add(type(draft).__name__)
            return draft

        drafter.propose = spy
        results[device_drafts] = dec.generate(pages, LENGTH)
    assert kinds == {True: {DeviceDraft.__name__}, False: {"list"}}
    on_device, on_host = results[True], results[False]
    assert on_device.output_ids == on_host.output_ids and on_device.logprobs == on_host.logprobs
    if mode == "lossless":
        assert on_device.output_ids == official_generate(tiny, pages, "multi", LENGTH).output_ids
    a, b = on_device.extra["speculative"], on_host.extra["speculative"]
    assert a["device_drafts"] is True and b["device_drafts"] is False
    for key in ("verify_rounds", "single_steps", "draft_tokens", "accepted_tokens", "relaxed_tokens", "drafters"):
        assert a[key] == b[key], key
    assert a["verify_rounds"] > 0 and (mode == "lossless" or a["relaxed_tokens"] > 0)


def test_a_step_stages_a_draft_written_on_the_device_and_names_it_in_its_rows(tiny):
    from engine.official import official_inputs
    from engine.static_runner import StaticRswaRunner

    runner = StaticRswaRunner(tiny.model, 7)
    runner.prefill(official_inputs(tiny, [text_page(0)], "single"))
    draft = [11, 12, 13, 14]
    want = runner.step([5, *draft])
    got = runner.step([5], device_tail=torch.tensor(draft))
    assert got == want and [row[4] for row in got[:-1]] == draft
    with pytest.raises(ValueError):
        runner.step([5], device_tail=torch.arange(7))  # 8 tokens: wider than the runner's widest step


@pytest.mark.parametrize("memory,linear", [(False, "torch"), (True, "torch"), (True, "bmv")])
def test_the_static_block_drafter_drafts_what_the_eager_one_drafts(tiny, memory, linear):
    """Same network, same feeds (the prompt, then rounds of 1, 2, 5 and 40 inputs): the static-buffer drafter
    (padded page memory, context shifted in place; its linears as F.linear or batched GEMVs) proposes the eager
    drafter's tokens, decode after decode."""
    net = _net(tiny, context=16, block=6, memory=memory)
    model = tiny.model
    embed, head = model.get_input_embeddings(), model.lm_head
    static = StaticBlockDrafter(net, embed, head, graphs=False, memory_bucket=64, linear=linear)
    width = len(net.config.layers) * model.config.text_config.hidden_size
    gen = torch.Generator().manual_seed(3)
    for prompt_len in (70, 128):  # a padded bucket, then one that fits exactly: state is reset between decodes
        eager = BlockDrafter(net, embed, head)
        static.start()
        ids = [5]
        feeds = [prompt_len, 1, 2, 5, 40, 1]
        for n in feeds:
            features = torch.randn(n, width, generator=gen)
            eager.feed(features)
            static.feed(features)
            if n != prompt_len:
                ids += [(7 * len(ids)) % 50 + 1 for _ in range(n)]
            want = eager.propose(ids, 6)
            assert want and static.propose(ids, 6) == want
            assert static.propose(ids, 3) == want[:3]
        assert static.bucket == (128 if memory else 0) and torch.equal(static.ctx[0], eager._buffer)


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

    copy, costly = Copy(), Costly()
    policy = DraftPolicy([copy, costly], k_max=16)
    copy.length = 6  # longer than the block could ever be: its forward is skipped
    assert policy.propose([0], 16) == ("copy", [1] * 6) and costly.asked == 0
    copy.length = 4  # as long as its cap: a tie goes to the first anyway
    assert policy.propose([0], 16) == ("copy", [1] * 4) and costly.asked == 0
    copy.length = 3
    assert policy.propose([0], 16) == ("block", [2] * 4) and costly.asked == 1
    assert policy.propose([0], 2) == ("copy", [1] * 2) and costly.asked == 1  # room 2: the copy's 2 already do


def test_chunks_with_a_full_copy_source_decode_without_the_block_drafter(tiny):
    """Default: a text layer on every page (or replay ids) leaves the block network out; a chunk with a page
    that has nothing to copy keeps it."""
    net = _net(tiny)
    dec = SpeculativeDecoder(tiny, mode="lossless", block_net=net)
    names = lambda texts, replay=None: [d.name for d in dec._drafters("multi", texts, replay)]  # noqa: E731
    assert "block" not in names(["page one text", "page two text"])
    assert "block" not in names(None, [1, 2, 3])
    assert "block" in names(["page one text", "  "]) and "block" in names(None)
    both = SpeculativeDecoder(tiny, mode="lossless", block_net=net, block_beside_copies=True)
    assert "block" in [d.name for d in both._drafters("multi", ["page one text"], None)]


def test_the_compiled_static_block_drafter_drafts_what_the_eager_one_drafts(tiny):
    """``compile=True``: the draft body through torch.compile (inductor's CPU backend here) proposes the eager
    drafter's tokens; a decode with it stays token-identical to official."""
    from engine.fast_decoder import FastDecoder

    net = _net(tiny, context=16, block=6, memory=True)
    model = tiny.model
    embed, head = model.get_input_embeddings(), model.lm_head
    static = StaticBlockDrafter(net, embed, head, graphs=False, memory_bucket=64, compile=True)
    eager = BlockDrafter(net, embed, head)
    width = len(net.config.layers) * model.config.text_config.hidden_size
    gen = torch.Generator().manual_seed(5)
    ids = [5]
    for n in (70, 1, 3):
        features = torch.randn(n, width, generator=gen)
        eager.feed(features)
        static.feed(features)
        if n != 70:
            ids += [(11 * len(ids)) % 50 + 1 for _ in range(n)]
        try:
            got = static.propose(ids, 6)
        except Exception as exc:  # noqa: BLE001
            pytest.skip(f"torch.compile unavailable: {exc}")
        if static.compile_error:
            pytest.skip(f"torch.compile unavailable: {static.compile_error}")
        assert static.compiled and got == eager.propose(ids, 6)

    pages = [text_page(i) for i in range(2)]
    official = official_generate(tiny, pages, "multi", LENGTH).output_ids
    dec = FastDecoder(tiny, mode="lossless", k_max=6, drafters=("block",), block_net=net, backend="static",
                      compile_draft=True)
    res = dec.generate(pages, LENGTH)
    assert res.output_ids == official and res.extra["speculative"]["draft_compiled"]


def test_train_drafter_decodes_with_the_init_drafter_and_live_checks_after_a_warmup(tmp_path):
    """`--data decode --init D` decodes the teacher pages with `lossless` + D (same tokens, or the teacher forward
    would refuse them); `--eval-only` live-checks a drafter after one untimed warm-up chunk on both sides."""
    from scripts.train_drafter import main

    model = build_tiny_model(tmp_path / "target", sliding_window=8, seed=3, text_init=0.02)
    common = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "50"]
    first, second = tmp_path / "d1", tmp_path / "d2"
    assert main([*common, "--pages", "2", "--steps", "20", "--batch", "16", "--block", "4", "--dim", "64",
                 "--data", "labels", "--out", str(first)]) == 0
    record_path = tmp_path / "record.json"
    assert main([*common, "--pages", "2", "--steps", "5", "--batch", "16", "--data", "decode", "--init", str(first),
                 "--out", str(second), "--json", str(record_path)]) == 0
    assert json.loads(record_path.read_text())["decode_s"] > 0
    assert main([*common, "--eval-only", "--init", str(second), "--eval-pages", "2", "--decoded-heldout-pages", "2",
                 "--json", str(record_path)]) == 0
    record = json.loads(record_path.read_text())
    assert record["decoded_heldout"]["pages"] == 2 and 0 <= record["decoded_heldout"]["tau"] <= 4
    ev = record["eval"]
    assert ev["identical"] == ev["chunks"] == 2 and ev["warmup_chunks"] == 1 and ev["warmup_s"]["block"] > 0
    assert ev["draft_compiled"] is None  # the eager engine on the CPU: no static drafter


@pytest.mark.parametrize("sits_out,full_k", [(True, False), (False, False), (True, True)])
def test_the_offline_policy_replay_counts_the_rounds_the_engine_runs(tiny, sits_out, full_k):
    """scripts/simulate_policy.py replays the block drafter's policy on teacher features: a partly trained drafter
    (hits and misses) gives the engine's own rounds, single steps and tau."""
    from scripts.simulate_policy import simulate
    from scripts.train_drafter import train

    pages = [text_page(i) for i in range(2)]
    official = official_generate(tiny, pages, "multi", LENGTH).output_ids
    net = _net(tiny, context=16, block=6, memory=True)
    seq = teacher_features(tiny, pages, official, net.config.layers)
    torch.manual_seed(0)
    train(net.requires_grad_(True), tiny, [seq], steps=160, seconds=None, batch=32, lr=3e-3, seed=0, anchors=16)
    net.requires_grad_(False).eval()
    dec = SpeculativeDecoder(tiny, mode="lossless", k_max=6, drafters=("block",), block_net=net,
                             block_sits_out=sits_out, block_full_k=full_k)
    live = dec.generate(pages, LENGTH).extra["speculative"]
    model = tiny.model
    sim = simulate(net, [seq], model.get_input_embeddings(), model.lm_head, tiny.eos_token_id, sits_out, full_k)
    assert 0.3 < live["tau"] < 5 and (live["single_steps"] > 0) == sits_out  # hits, misses, benched rounds
    assert (sim["rounds"], sim["singles"], sim["accepted"]) == (live["verify_rounds"], live["single_steps"],
                                                                 live["accepted_tokens"])
