"""A user's own data: prompt masking from a line's ``labels`` (-100: not counted) or
``loss_mask``, the loss counting exactly those tokens -- the step's reported loss equals plain
transformers' ``labels=`` loss on the same rows -- a field the run does not read named once,
and ``--seq-len`` meaning one thing with and without ``--data``."""

import json

import pytest
import torch

from .conftest import PLANS, forked_cli

QWEN3 = PLANS / "qwen3.yaml"


def _lines():
    gen = torch.Generator().manual_seed(11)

    def ids(n):
        return torch.randint(0, 256, (n,), generator=gen).tolist()

    first, second, third, fourth = ids(10), ids(7), ids(12), ids(5)
    return [
        {"input_ids": first, "labels": [-100] * 4 + first[4:]},
        {"input_ids": second, "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
        {"input_ids": third},  # every token counts
        {"input_ids": fourth, "labels": [-100, -100, *fourth[2:]], "source": "web"},
    ]


def _expected_loss(lines) -> float:
    """transformers' own causal-LM loss with ``labels`` (-100 where a token does not count and
    at padding), on the seeded weights ``plancc apply`` starts from: the mean over the batch."""
    from plancc.engine.parallel_model import seeded_model
    from plancc.models import load_config

    model = seeded_model(load_config("tiny-qwen3"), 0)
    width = max(len(line["input_ids"]) for line in lines)
    ids = torch.zeros(len(lines), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, line in enumerate(lines):
        n = len(line["input_ids"])
        ids[row, :n] = torch.tensor(line["input_ids"])
        mask[row, :n] = 1
        if "labels" in line:
            labels[row, :n] = torch.tensor(line["labels"])
        elif "loss_mask" in line:
            keep = torch.tensor(line["loss_mask"]).bool()
            labels[row, :n] = torch.where(keep, ids[row, :n], torch.full_like(ids[row, :n], -100))
        else:
            labels[row, :n] = ids[row, :n]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_step_loss_counts_exactly_the_tokens_labels_and_loss_mask_say(tmp_path):
    lines = _lines()
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = forked_cli("apply", QWEN3, "--data", data, "--steps", 1, "--batch-size", 4,
                                "--metrics", tmp_path / "m.jsonl")
    assert code == 0, err
    (step,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert step["loss"] == pytest.approx(_expected_loss(lines), abs=1e-5)
    # the field the run does not read, named once
    (warning,) = [x for x in err.splitlines() if "[data-unused-field]" in x]
    assert "'source'" in warning and "read as token ids: input_ids, labels, loss_mask" in warning
    assert "the loss counts the tokens its masks count" in out
    assert "rows as they are (the longest 12 tokens" in out


def test_a_line_whose_labels_are_not_its_tokens_is_refused_at_its_line(cli, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2, 3], "labels": [-100, 7, 3]}\n')
    code, out, err = cli("apply", QWEN3, "--data", data)
    assert code == 1 and f"{data}:2:1: error: labels[1] is 7" in err and "[data-mask]" in err


def test_a_line_longer_than_the_model_takes_is_refused_by_apply_unless_seq_len_cuts_it(cli, tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"input_ids": [1] * 600}) + "\n" + json.dumps({"input_ids": [2, 3]}) + "\n")
    code, out, err = cli("apply", QWEN3, "--data", data)
    assert code == 1 and f"{data}:1:1: error: the line has 600 tokens" in err and "[data-too-long]" in err
    code, out, err = cli("apply", QWEN3, "--data", data, "--seq-len", 1000)
    assert code == 2 and "--seq-len 1000 is beyond the model's max_position_embeddings (512)" in err


CHAT_TEMPLATE = (  # ChatML, with transformers' generation markers around the assistant's turns
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["hello world, how are you today?", "the quick brown fox jumps over the lazy dog", "user assistant system"]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A model folder as a user brings one, made here without a hub: a byte-level BPE of 300
    tokens trained in the test (``tokenizers``), a ChatML template, and a tiny Qwen3 of that
    vocabulary with weights of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from plancc.models import build_model, load_config

    folder = tmp_path_factory.mktemp("chat-model")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(CORPUS * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = load_config("tiny-qwen3")
    config.vocab_size = 320  # the tokenizer's 300, rounded up as real vocabularies are
    torch.manual_seed(5)
    build_model(config, device="cpu").save_pretrained(folder)
    return folder


CHATS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the quick fox"},
     {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "lazy dog today"}],
    [{"role": "system", "content": "user assistant"}, {"role": "user", "content": "world"},
     {"role": "assistant", "content": "hello world"}],
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chat_data_trains_on_the_assistants_tokens_only(chat_folder, tmp_path):
    """A chat rendered with the folder's template; the step's loss equals transformers' own loss
    with labels from the template's assistant mask (its {% generation %} markers), which plancc
    does not read: it finds each assistant turn as what the turn adds to the prompt before it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": chat, "id": i}) + "\n" for i, chat in enumerate(CHATS)))
    code, out, err = forked_cli("apply", QWEN3, "--model", chat_folder, "--data", data, "--steps", 1,
                                "--batch-size", 2, "--metrics", tmp_path / "m.jsonl")
    assert code == 0, err
    (step,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    (unused,) = [x for x in err.splitlines() if "[data-unused-field]" in x]
    assert "'id'" in unused and "read as a chat: messages" in unused and "input_ids" not in unused  # what it read

    tokenizer = AutoTokenizer.from_pretrained(chat_folder)
    rendered = [tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True) for chat in CHATS]
    width = max(len(r["input_ids"]) for r in rendered)
    ids = torch.zeros(len(CHATS), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, r in enumerate(rendered):
        n = len(r["input_ids"])
        ids[row, :n] = torch.tensor(r["input_ids"])
        mask[row, :n] = 1
        keep = torch.tensor(r["assistant_masks"]).bool()
        labels[row, :n] = torch.where(keep, ids[row, :n], torch.full_like(ids[row, :n], -100))
    model = AutoModelForCausalLM.from_pretrained(chat_folder, dtype=torch.float32)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    assert step["loss"] == pytest.approx(expected, abs=1e-5)


def test_prompt_and_completion_count_the_completion_and_text_counts_everything(chat_folder, tmp_path):
    from plancc.job.data import DataFields, Tokenizer, read_jsonl

    data = tmp_path / "pc.jsonl"
    data.write_text(json.dumps({"question": "how are you", "answer": "lazy dog"}) + "\n"
                    + json.dumps({"body": "hello world"}) + "\n")
    fields = DataFields(prompt="question", completion="answer", text="body")
    ds = read_jsonl(data, vocab_size=320, min_tokens=2, fields=fields, tokenizer=Tokenizer(str(chat_folder)))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_folder)
    prompt, completion = tok("how are you")["input_ids"], tok("lazy dog", add_special_tokens=False)["input_ids"]
    assert ds.sequences[0] == (*prompt, *completion, tok.eos_token_id)
    assert ds.masks[0] == (0,) * len(prompt) + (1,) * (len(completion) + 1)
    assert ds.sequences[1] == (*tok("hello world")["input_ids"], tok.eos_token_id) and ds.masks[1] is None
    assert ds.unused == ()


def test_chats_as_datasets_hold_them_text_parts_and_tool_calls_train_and_the_rest_is_named(chat_folder, tmp_path):
    """OpenAI-style content parts are the text they hold, joined by newlines as vLLM renders them
    for a text model (the prompt a rollout saw); an assistant turn of tool calls has no content;
    an image part, a content of another kind, an empty chat and ShareGPT's messages are each named
    at their line."""
    from plancc.job.data import DataError, Tokenizer, read_jsonl

    def parts(*texts):
        return [{"type": "text", "text": t} for t in texts]

    as_strings = [{"role": "user", "content": "hello\nworld"}, {"role": "assistant", "content": "the quick fox"}]
    as_parts = [{"role": "user", "content": parts("hello", "world")},
                {"role": "assistant", "content": parts("the quick fox")}]
    calls = [{"role": "user", "content": "hello"},
             {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
             {"role": "tool", "content": "world"}, {"role": "assistant", "content": "lazy dog"}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (as_strings, as_parts, calls)))
    ds = read_jsonl(data, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(chat_folder)))
    assert ds.sequences[0] == ds.sequences[1] and ds.masks[0] == ds.masks[1] and 1 in ds.masks[0]
    assert sum(ds.masks[2]) > 0  # the turn after the tool's answer counts

    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (
        as_strings,
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 5}],
        [],
        "hello",
        [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "world"}],
        [{"speaker": "user", "text": "hello"}],
    )))
    with pytest.raises(DataError) as caught:
        read_jsonl(bad, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(chat_folder)))
    found = {d.loc.line: d.message for d in caught.value.diagnostics}
    assert sorted(found) == [2, 3, 4, 5, 6, 7] and all(d.rule == "data-messages" for d in caught.value.diagnostics)
    assert "messages[0]'s content holds a part of type 'image_url'" in found[2]
    assert "messages[0]'s content is a number" in found[3]
    assert "found an empty list" in found[4] and "found a string" in found[5]
    assert "messages[0] is a ShareGPT message" in found[6]
    assert "messages[0] must be an object with a 'role' string; found an object of the keys 'speaker', 'text'" in found[7]
    assert all(d.fix and "input_ids" not in d.fix for d in caught.value.diagnostics)


# Qwen3's behaviour (not its text): the last assistant turn after the last user message renders
# an empty thinking block, an earlier one none -- a conversation that is no extension of its
# prefixes. GEN / ENDGEN: where a training template puts transformers' generation marks.
QWEN3_LIKE = (
    "{% set ns = namespace(last=0) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}GEN"
    "{% if loop.index0 > ns.last and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>' }}ENDGEN"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_marking_the_assistants_turns_is_read_where_its_prefixes_do_not_extend(chat_folder, tmp_path):
    """A multi-turn chat under a Qwen3-like template: refused (the turns cannot be told apart
    from prefixes), naming the way out; with ``{% generation %}`` marks in the same template, the
    loss counts what the marks enclose -- each turn as the whole conversation renders it, the
    last one's thinking block included."""
    from transformers import AutoTokenizer

    from plancc.job.data import DataError, Tokenizer, read_jsonl

    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the quick fox"},
            {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "lazy dog"}]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n")
    tok = AutoTokenizer.from_pretrained(chat_folder)
    for name, template in (("plain", QWEN3_LIKE.replace("ENDGEN", "").replace("GEN", "")),
                           ("marked", QWEN3_LIKE.replace("ENDGEN", "{% endgeneration %}").replace("GEN", "{% generation %}"))):
        tok.chat_template = template
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(DataError) as caught:
        read_jsonl(data, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(tmp_path / "plain")))
    (found,) = caught.value.diagnostics
    assert "does not render message 1 as an extension" in found.message and "{% generation %}" in found.fix

    ds = read_jsonl(data, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(tmp_path / "marked")))
    ids, mask = ds.sequences[0], ds.masks[0]
    spans, start = [], None
    for i, counted in enumerate((*mask, 0)):
        if counted and start is None:
            start = i
        elif not counted and start is not None:
            spans.append(tok.decode(ids[start:i]))
            start = None
    assert spans == ["the quick fox<|im_end|>", "<think>\n\n</think>\n\nlazy dog<|im_end|>"]


def test_a_conversational_prompt_and_completion_counts_the_completions_turns_alone(chat_folder, tmp_path):
    """TRL's conversational prompt-completion (both lists of messages): the chat they make, its
    loss counting the completion's assistant turns and not the prompt's -- read from a template's
    generation marks and from its prefixes alike."""
    from transformers import AutoTokenizer

    from plancc.job.data import Tokenizer, read_jsonl

    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the quick fox"},
            {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "lazy dog"}]
    data = tmp_path / "pc.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n"
                    + json.dumps({"prompt": chat[:3], "completion": chat[3:]}) + "\n"
                    + json.dumps({"prompt": chat[:1], "completion": chat[1:2]}) + "\n"
                    + json.dumps({"messages": chat[:2]}) + "\n")
    tok = AutoTokenizer.from_pretrained(chat_folder)
    tok.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok.save_pretrained(tmp_path / "unmarked")
    for folder in (chat_folder, tmp_path / "unmarked"):
        ds = read_jsonl(data, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(folder)))
        whole, completion, single, single_chat = ((ds.sequences[i], ds.masks[i]) for i in range(4))
        assert completion[0] == whole[0] and single == single_chat, folder
        first_turn = single_chat[1].index(1) + sum(single_chat[1])  # where the chat's first reply ends
        assert completion[1] == (0,) * first_turn + whole[1][first_turn:] and sum(completion[1]) < sum(whole[1])


def test_text_without_a_tokenizer_is_refused_at_its_line(cli, tmp_path):
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    code, out, err = cli("apply", QWEN3, "--data", data)
    assert code == 1 and f"{data}:1:1: error:" in err and "[data-tokenizer]" in err and "no tokenizer" in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_parquet_dataset_of_chats_trains_as_the_same_jsonl(chat_folder, tmp_path):
    """The same chats as a parquet file (read streaming by Hugging Face datasets) and as a
    dataset saved with save_to_disk give the JSONL run's step loss."""
    import datasets

    rows = [{"messages": chat} for chat in CHATS]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chats.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    losses = []
    for data in ("chats.jsonl", "chats.parquet", "saved"):
        code, out, err = forked_cli("apply", QWEN3, "--model", chat_folder, "--data", tmp_path / data, "--steps", 1,
                                    "--batch-size", 2, "--nproc-per-node", 1, "--metrics", tmp_path / f"{data}.m")
        assert code == 0, err
        losses.append(json.loads((tmp_path / f"{data}.m").read_text())["loss"])
    assert losses[0] == losses[1] == losses[2]


def test_a_folder_laid_out_as_the_hub_lays_a_dataset_trains_on_its_train_split_alone(tmp_path):
    """``data/train-*.parquet`` beside ``data/test-*.parquet`` (or ``train/`` beside ``validation/``):
    the train split is read and the others said left out on the log's data line; a folder of
    splits none of which is train is refused; a folder whose files name no split is read whole."""
    import datasets

    from plancc.job.data import DataError, read_jsonl
    from plancc.job.hf_datasets import split_note

    def parquet(path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list([{"input_ids": r} for r in rows]).to_parquet(str(path))

    parquet(tmp_path / "hub/data/train-00000-of-00002.parquet", [[1, 2, 3], [4, 5]])
    parquet(tmp_path / "hub/data/train-00001-of-00002.parquet", [[6, 7]])
    parquet(tmp_path / "hub/data/test-00000-of-00001.parquet", [[9, 9, 9]])
    parquet(tmp_path / "dirs/train/a.parquet", [[1, 2]])
    parquet(tmp_path / "dirs/validation/a.parquet", [[9, 9]])
    parquet(tmp_path / "held-out/test-0.parquet", [[9, 9]])
    parquet(tmp_path / "held-out/validation-0.parquet", [[8, 8]])
    parquet(tmp_path / "shards/part-0.parquet", [[1, 2]])
    parquet(tmp_path / "shards/part-1.parquet", [[3, 4]])

    for folder, want, note in (("hub", [(1, 2, 3), (4, 5), (6, 7)], " (its train split; test left out)"),
                               ("hub/data", [(1, 2, 3), (4, 5), (6, 7)], " (its train split; test left out)"),
                               ("dirs", [(1, 2)], " (its train split; validation left out)"),
                               ("shards", [(1, 2), (3, 4)], "")):
        ds = read_jsonl(tmp_path / folder, vocab_size=256)
        assert sorted(ds.sequences) == want and split_note(tmp_path / folder) == note, folder
    with pytest.raises(DataError) as caught:
        read_jsonl(tmp_path / "held-out", vocab_size=256)
    (found,) = caught.value.diagnostics
    assert found.rule == "data-file" and "the splits test, validation and none named train" in found.message
    # a folder of a held-out split alone (a test split, a saved DatasetDict of validation alone) is
    # refused too: it was trained on without a word
    parquet(tmp_path / "test-only/data/test-00000-of-00001.parquet", [[9, 9, 9]])
    datasets.DatasetDict({"validation": datasets.Dataset.from_list([{"input_ids": [8, 8]}])}).save_to_disk(
        str(tmp_path / "saved-validation"))
    for folder, split in (("test-only", "test"), ("saved-validation", "validation")):
        with pytest.raises(DataError) as caught:
            read_jsonl(tmp_path / folder, vocab_size=256)
        (found,) = caught.value.diagnostics
        assert found.rule == "data-file" and f"holds the {split} split alone" in found.message, folder


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_resume_on_other_rows_than_the_checkpoints_run_says_so(tmp_path):
    """A checkpoint keeps a digest of the rows its run trained on; a resume on the same rows says
    nothing, one on other rows -- a row changed, a row added, no --data -- says in one note that
    the steps after the checkpoint are not the saved run's."""
    lines = _lines()
    same, changed, longer = (tmp_path / f"{name}.jsonl" for name in ("same", "changed", "longer"))
    same.write_text("".join(json.dumps(line) + "\n" for line in lines))
    edited = [dict(line) for line in lines]
    edited[2]["input_ids"] = [(t + 1) % 256 for t in edited[2]["input_ids"]]
    changed.write_text("".join(json.dumps(line) + "\n" for line in edited))
    longer.write_text(same.read_text() + json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    run = ("apply", QWEN3, "--steps", 2, "--batch-size", 2, "--nproc-per-node", 1)
    code, out, err = forked_cli(*run, "--data", same, "--save", tmp_path / "ck", "--save-every", 1)
    assert code == 0, err
    notes = {}
    for name, data in (("same", ["--data", same]), ("changed", ["--data", changed]), ("longer", ["--data", longer]),
                       ("synthetic", []), ("wider", ["--data", same, "--batch-size", 4]),
                       ("cut", ["--data", same, "--seq-len", 8])):
        code, out, err = forked_cli(*run, *data, "--resume", tmp_path / "ck" / "step-000001")
        assert code == 0 and "resumed from step 1" in out, err
        notes[name] = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes["same"] == []
    assert notes["changed"] == ["note: the data holds other rows than the checkpoint's run's (4 rows either way): "
                                "the steps after 1 train on other batches than the run that saved the checkpoint "
                                "would have"]
    (added,) = notes["longer"]
    assert "4 rows of 34 tokens -> 5 of 37" in added
    (synthetic,) = notes["synthetic"]
    assert "the checkpoint's run trained on --data (4 rows), this one on synthetic rows" in synthetic
    # the same rows, another batch shape: the steps after the checkpoint take other rows too
    assert notes["wider"] == ["note: --batch-size 2 -> 4: the steps after 1 train on other batches than the run "
                              "that saved the checkpoint would have"]
    # --seq-len 8 cuts the longer lines into rows (every token kept): other rows than the run's
    (cut,) = notes["cut"]
    assert "4 rows of 34 tokens -> 6 of 36" in cut, cut


def test_a_bad_row_of_a_parquet_file_is_named_by_its_row(tmp_path):
    import datasets

    from plancc.job.data import DataError, read_jsonl

    datasets.Dataset.from_list([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 999]}]).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(DataError) as caught:
        read_jsonl(tmp_path / "d.parquet", vocab_size=256)
    (found,) = caught.value.diagnostics
    assert found.rule == "data-token-range" and found.loc.line == 2 and "999" in found.message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packed_rows_keep_their_masks_and_document_boundaries(tmp_path):
    """--pack puts a microbatch's records into one row with their boundaries (each attends to
    itself alone): the step's loss with prompt masks is the unpacked step's."""
    lines = _lines()
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    losses = []
    for packing in ([], ["--pack", "--micro-batch-size", 2]):
        code, out, err = forked_cli("apply", QWEN3, "--data", data, "--steps", 1, "--batch-size", 4, *packing,
                                    "--metrics", tmp_path / f"m{len(packing)}.jsonl")
        assert code == 0, err
        losses.append(json.loads((tmp_path / f"m{len(packing)}.jsonl").read_text())["loss"])
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    assert losses[0] == pytest.approx(_expected_loss(lines), abs=1e-5)


@pytest.mark.timeout(300)
def test_the_data_read_holds_row_offsets_not_the_tokens(tmp_path):
    """A dataset larger than memory: the rows go to a file as they are read (and the workers map
    the launcher's copy), so reading 4M token ids -- ~140 MB as Python tuples of ints -- raises
    the reader's peak memory by the rows' offsets and a buffer, not by the tokens."""
    import subprocess
    import sys

    data = tmp_path / "big.jsonl"
    ids = list(range(100_000, 101_000))  # ids above the small-int cache: 28 bytes each in a tuple
    line = json.dumps({"input_ids": ids}) + "\n"
    data.write_text(line * 4000)
    probe = f"""
import resource
from plancc.job.data import read_jsonl, read_tokens, write_tokens
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = peak()
ds = read_jsonl({str(data)!r}, vocab_size=150_000)
write_tokens(ds, {str(tmp_path / 'copy')!r})
back = read_tokens({str(tmp_path / 'copy')!r})
assert len(back.sequences) == 4000 and back.sequences[3999] == tuple(range(100_000, 101_000))
print(peak() - before)
"""
    grown = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    assert grown < 48 * 2**20, f"{grown / 2**20:.0f} MiB"


def _rows(data):
    """(ids, mask or None) of every row, as plain lists."""
    masks = list(data.masks) if data.masks is not None else [None] * len(data.sequences)
    return [(list(ids), None if mask is None else list(mask)) for ids, mask in zip(data.sequences, masks)]


def test_padding_its_attention_mask_marks_is_not_trained_on(cli, tmp_path):
    """tokenizer(..., padding="max_length") rows: id 0 on the padding, attention_mask 0 there (right
    or left). They read as the unpadded rows (the loss then is theirs: it was 5.6909 against 5.5622)."""
    from plancc.job.data import DataError, read_jsonl

    plain = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11], "labels": [-100, 10, 11]}]
    padded = [
        {"input_ids": [5, 6, 7, 8, 0, 0], "attention_mask": [1, 1, 1, 1, 0, 0]},
        {"input_ids": [0, 0, 9, 10, 11, 0], "attention_mask": [0, 0, 1, 1, 1, 0], "labels": [-100, -100, -100, 10, 11, -100]},
    ]
    for name, lines in (("plain", plain), ("padded", padded)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    read = {name: _rows(read_jsonl(tmp_path / f"{name}.jsonl", vocab_size=256, min_tokens=2)) for name in ("plain", "padded")}
    assert read["padded"] == read["plain"] == [([5, 6, 7, 8], None), ([9, 10, 11], [0, 1, 1])]
    # a hole inside the attended tokens (packed documents in one line) is refused at its line
    (tmp_path / "holes.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7, 8], "attention_mask": [1, 0, 1, 1]}) + "\n")
    with pytest.raises(DataError) as caught:
        read_jsonl(tmp_path / "holes.jsonl", vocab_size=256, min_tokens=2)
    (found,) = caught.value.diagnostics
    assert found.rule == "data-mask" and found.loc.line == 1 and "leaves out token 1" in found.message


def test_a_parquet_made_from_valid_jsonl_reads_as_that_jsonl(tmp_path):
    """Rows with labels, with loss_mask and with neither, through datasets' JSON reader to parquet:
    the columns a row lacks come back null, and are read as absent (they were refused as "both
    'labels' and 'loss_mask'")."""
    import datasets

    from plancc.job.data import read_jsonl

    lines = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8, 9, 10], "loss_mask": [0, 0, 1]},
        {"input_ids": [11, 12]},
        {"input_ids": [13, 14, 15], "attention_mask": [1, 1, 0]},
    ]
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    datasets.Dataset.from_json(str(jsonl)).to_parquet(str(tmp_path / "mixed.parquet"))
    as_jsonl = read_jsonl(jsonl, vocab_size=256, min_tokens=2)
    as_parquet = read_jsonl(tmp_path / "mixed.parquet", vocab_size=256, min_tokens=2)
    assert _rows(as_parquet) == _rows(as_jsonl) == [
        ([5, 6, 7], [0, 1, 1]), ([8, 9, 10], [0, 0, 1]), ([11, 12], None), ([13, 14], None)
    ]
    assert as_parquet.unused == as_jsonl.unused == ()


def test_a_chat_template_that_never_finishes_is_stopped_and_named(chat_folder, tmp_path, monkeypatch):
    """A template is a program: two nested range(100000) loops rendered for ever, with no bound."""
    import shutil

    from plancc.job import records
    from plancc.job.data import DataError, read_jsonl
    from plancc.job.records import Tokenizer

    folder = tmp_path / "model"
    shutil.copytree(chat_folder, folder)
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHAT_TEMPLATE
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = endless
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(endless)
    monkeypatch.setattr(records, "TEMPLATE_SECONDS", 1)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    with pytest.raises(DataError) as caught:
        read_jsonl(data, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(folder)))
    (found,) = caught.value.diagnostics
    assert found.rule == "data-messages" and found.loc.line == 1
    assert "did not finish rendering" in found.message and "within 1 s" in found.message


def test_a_document_longer_than_seq_len_becomes_rows_with_every_token_kept():
    """Each row starts at the token the row before ended on: every token after the first is
    predicted exactly once (a row's first position predicts nothing), and a row whose mask
    counts nothing after its first position is left out."""
    from plancc.job.records import rows_of

    ids = tuple(range(100_000))
    rows = rows_of(ids, None, 16384)
    assert len(rows) == 7 and all(len(r) <= 16384 for r, _ in rows)
    predicted = [t for r, _ in rows for t in r[1:]]
    assert predicted == list(ids[1:])  # every token, once, in order
    assert rows_of(ids[:10], None, 16) == [(ids[:10], None)]
    mask = (0,) * 12 + (1,) * 8  # only the tail counts: the row of tokens 0..7 trains nothing
    kept = rows_of(tuple(range(20)), mask, 8)
    assert [r[0] for r, _ in kept] == [7, 14] and [m for _, m in kept] == [mask[7:15], mask[14:20]]


def test_seq_len_cuts_text_and_token_ids_into_rows_and_refuses_a_longer_chat_at_its_line(chat_folder, tmp_path):
    from plancc.job.data import DataError, read_jsonl, read_tokens, write_tokens
    from plancc.job.records import Tokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(3, 103))}) + "\n"
                    + json.dumps({"text": " ".join(CORPUS * 6)}) + "\n" + json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    ds = read_jsonl(data, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(chat_folder)), row_length=16)
    assert ds.documents == 3 and len(ds.sequences) > 3 and max(ds.lengths()) <= 16
    first = [t for row in list(ds.sequences)[:7] for t in row[1:]]
    assert first == list(range(4, 103))  # the 100 ids as 7 rows, every token predicted once
    write_tokens(ds, tmp_path / "copy")  # the workers' copy keeps the count
    assert read_tokens(tmp_path / "copy").documents == 3
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": " ".join(CORPUS)},
                                             {"role": "assistant", "content": " ".join(CORPUS)}]}) + "\n")
    with pytest.raises(DataError) as err:
        read_jsonl(chat, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(chat_folder)), row_length=16)
    (problem,) = err.value.diagnostics
    assert problem.rule == "data-too-long" and problem.loc.line == 1 and "never cut into rows" in problem.message
    # without --seq-len the same chat trains whole
    assert len(read_jsonl(chat, vocab_size=320, min_tokens=2, tokenizer=Tokenizer(str(chat_folder))).sequences) == 1
    code, out, err = forked_cli("apply", QWEN3, "--data", _ids_only(data), "--seq-len", 16, "--steps", 1,
                                "--nproc-per-node", 1)
    assert code == 0, err
    assert "2 documents as 8 rows of at most --seq-len 16 tokens (a longer document cut into rows" in out, out


def _ids_only(path):
    """The token-id lines of a data file (no tokenizer needed)."""
    lines = [line for line in path.read_text().splitlines() if "input_ids" in line]
    out = path.with_name("ids.jsonl")
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_long_document_trains_as_rows_under_cp_and_each_rows_loss_is_the_unsharded_models(tmp_path):
    """A 3000-token document at --seq-len 512 --cp 2: 6 rows, a step each, every row's loss
    equal to the unsharded model's (verify's per-step losses; ``--extended`` runs it at the
    issue's 100k tokens and --seq-len 16384)."""
    _long_document_verifies(tmp_path, tokens=3000, seq_len=512, steps=6)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_100k_token_document_trains_as_rows_of_16k_under_cp_exactly(tmp_path):
    _long_document_verifies(tmp_path, tokens=100_000, seq_len=16384, steps=7)


def _long_document_verifies(tmp_path, *, tokens, seq_len, steps):
    from plancc.models import load_config

    config = load_config("tiny-qwen3")
    config.max_position_embeddings = 131072
    config.save_pretrained(tmp_path / "model")
    gen = torch.Generator().manual_seed(0)
    data = tmp_path / "doc.jsonl"
    data.write_text(json.dumps({"input_ids": torch.randint(3, 250, (tokens,), generator=gen).tolist()}) + "\n")
    code, out, err = forked_cli("apply", QWEN3, "--model", tmp_path / "model", "--data", data, "--seq-len", seq_len,
                                "--batch-size", 1, "--steps", steps, "--nproc-per-node", 2, "--cp", 2, "--verify")
    assert code == 0 and "verify: OK" in out, out + err
    losses = [line for line in out.splitlines() if "loss after step" in line]
    assert len(losses) == steps  # the first row's loss is the "loss |diff|" line; each later row's a step's
