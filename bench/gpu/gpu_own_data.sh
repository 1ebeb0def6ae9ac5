#!/usr/bin/env bash
# One device call for issue 57 (docs/gpu.md, "own data"): a model folder with a tokenizer and a
# chat template (built by the test's recipe, no hub) trained on CUDA from JSONL chats -- the
# assistant-only loss through Policy's token_mask -- verified against the unsharded model, run
# from a run file, resumed from a checkpoint's run file.
. "$(dirname "$0")/gpu_setup.sh"
REPO=$PWD
cd /tmp && rm -rf demo && mkdir demo && cd demo
python3 - <<'PY'
import json, random, torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from plancc.models import build_model, load_config
corpus = ["hello world, how are you today?", "the quick brown fox jumps over the lazy dog", "user assistant system"]
bpe = Tokenizer(models.BPE()); bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False); bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
tok.save_pretrained("my-model")
config = load_config("tiny-qwen3"); config.vocab_size = 320; config.dtype = torch.bfloat16
torch.manual_seed(1); build_model(config, device="cpu").save_pretrained("my-model")
rng = random.Random(0); words = " ".join(corpus).replace(",", "").replace("?", "").split()
with open("chats.jsonl", "w") as f:
    for _ in range(64):
        f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=5))},
                                         {"role": "assistant", "content": " ".join(rng.choices(words, k=8))}]}) + "\n")
PY
P=$REPO/plans/qwen3.yaml
cat > sft.yaml <<YAML
plancc_run: 1
plan: $P
model: my-model
data: chats.jsonl
device: cuda
nproc_per_node: 1
batch_size: 8
lr: 2.0e-4
steps: 6
save: ck
save_every: 2
export_hf: my-model-sft
YAML
{
  echo '$ plancc apply plans/qwen3.yaml --model my-model --data chats.jsonl --device cuda --batch-size 8 --steps 2 --verify'
  python3 -m plancc.cli apply "$P" --model my-model --data chats.jsonl --device cuda --nproc-per-node 1 --batch-size 8 --steps 2 --verify 2>&1 | grep -v "^\[W" | tail -11
  echo '$ plancc apply --config sft.yaml --param-dtype bfloat16 --metrics straight.jsonl'
  python3 -m plancc.cli apply --config sft.yaml --param-dtype bfloat16 --metrics straight.jsonl 2>&1 | grep -v "^\[W\|Writing" | tail -12
  rm -r ck/step-000006 ck/latest
  echo '$ plancc apply --config ck/step-000004/run.yaml --resume ck --metrics resumed.jsonl'
  python3 -m plancc.cli apply --config ck/step-000004/run.yaml --resume ck --metrics resumed.jsonl 2>&1 | grep -v "^\[W\|Writing" | tail -6
  python3 -c "
import json
s = [json.loads(l) for l in open('straight.jsonl')][4:]; r = [json.loads(l) for l in open('resumed.jsonl')]
for a, b in zip(s, r): print('step', a['step'], 'lr', a['lr'], b['lr'], 'loss', a['loss'], b['loss'])"
  python3 -c "import json; print('export dtype', json.load(open('my-model-sft/config.json'))['dtype'])"
} | tee "$OUT/own_data_cuda.txt"
