"""Differential test: our IFEval checks against the reference implementation (lm-eval's
``tasks/ifeval``, a test-only dependency of the dev extra) on generated (instruction id,
kwargs, response) triples, strict and loose. Agreement must be >= 99%.

The reference modules are imported from the installed lm-eval by file path, so that
lm-eval's package __init__ (models, torch, datasets) is not run. Two reference checks need
NLTK's Punkt English model, which no PyPI package installs; for them the oracle puts the
reference's own rule-based ``split_into_sentences`` where Punkt would be (documented in
verifiers/ifeval.py): number_sentences counts its sentences, and capital_word_frequency
tokenizes each of them with NLTK's word tokenizer, as ``nltk.word_tokenize`` does Punkt's.

Besides the mixed triples of every id, the ids whose verdict turns on small details (the
nth paragraph's first word, the constrained options, the two responses' marker, the
repeated prompt, the Treebank tokens of capital words) get edge-case triples of their own,
each id held to the agreement bound by itself.
"""
from __future__ import annotations

import importlib.util
import random
import sys
import types
from importlib.metadata import distribution

import pytest

from verifiers import verify
from verifiers.ifeval import INSTRUCTIONS, followed
from verifiers.ifeval_text import words_treebank

pytestmark = pytest.mark.timeout(300)
REFERENCE_IDS = sorted(set(INSTRUCTIONS) - {"startend:start_with"})


@pytest.fixture(scope="module")
def reference():
    root = distribution("lm_eval").locate_file("lm_eval/tasks/ifeval")
    saved = {k: sys.modules.get(k) for k in ("lm_eval", "lm_eval.tasks", "lm_eval.tasks.ifeval")}
    for name, path in (("lm_eval", None), ("lm_eval.tasks", None), ("lm_eval.tasks.ifeval", root)):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)] if path else []
        sys.modules[name] = pkg
    mods = {}
    for name in ("instructions_util", "instructions", "instructions_registry"):
        spec = importlib.util.spec_from_file_location(f"lm_eval.tasks.ifeval.{name}", root / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mods[name]
        spec.loader.exec_module(mods[name])
    yield mods
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def reference_capital_words(mods, text: str) -> int:
    import nltk

    sentences = mods["instructions_util"].split_into_sentences(text)
    return sum(w.isupper() for s in sentences for w in nltk.tokenize.NLTKWordTokenizer().tokenize(s))


def reference_check(mods, iid: str, kwargs: dict, text: str) -> bool:
    util = mods["instructions_util"]
    if iid == "length_constraints:number_sentences":
        n = len(util.split_into_sentences(text))
        return n < kwargs["num_sentences"] if kwargs["relation"] == "less than" else n >= kwargs["num_sentences"]
    if iid == "change_case:capital_word_frequency":
        n = reference_capital_words(mods, text)
        want = kwargs["capital_frequency"]
        return n < want if kwargs["capital_relation"] == "less than" else n >= want
    checker = mods["instructions_registry"].INSTRUCTION_DICT[iid](iid)
    checker.build_description(**kwargs)
    return checker.check_following(text)


def reference_followed(mods, iid, kwargs, text, mode):
    if mode == "strict":
        variants = [text]
    else:
        r = text.split("\n")
        first, last, both = "\n".join(r[1:]).strip(), "\n".join(r[:-1]).strip(), "\n".join(r[1:-1]).strip()
        variants = [text, text.replace("*", ""), first, last, both] + [v.replace("*", "") for v in (first, last, both)]
    return any(v.strip() and reference_check(mods, iid, kwargs, v) for v in variants)


# ---- generated triples ----------------------------------------------------------------------
WORDS = ("river stone light quiet warm home blue simple slow bright garden window morning letter city "
         "music friend table answer problem market winter summer bridge forest").split()
KEYWORDS = "pepper violin glacier lantern compass".split()  # never in the filler text
LANG_TEXT = {
    "en": "The weather is nice today and we are going to walk in the park with our friends.",
    "fr": "Le temps est beau aujourd'hui et nous allons nous promener dans le parc avec nos amis.",
    "de": "Das Wetter ist heute schön und wir gehen mit unseren Freunden im Park spazieren.",
    "es": "El tiempo es agradable hoy y vamos a caminar por el parque con nuestros amigos.",
    "it": "Il tempo è bello oggi e andiamo a passeggiare nel parco con i nostri amici.",
    "ru": "Сегодня хорошая погода, и мы пойдем гулять в парк с нашими друзьями.",
    "ja": "今日は天気が良いので、友達と一緒に公園を散歩します。",
    "zh-cn": "今天天气很好，我们要和朋友们一起去公园散步。",
    "ko": "오늘은 날씨가 좋아서 친구들과 함께 공원을 산책할 거예요.",
    "ar": "الطقس جميل اليوم وسنذهب للتنزه في الحديقة مع أصدقائنا.",
    "hi": "आज मौसम अच्छा है और हम अपने दोस्तों के साथ पार्क में टहलने जाएंगे।",
}


def sentence(rng, caps=False, comma=False):
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
    if comma:
        words[rng.randrange(len(words))] += ","
    s = " ".join(words)
    s = s.upper() if caps else s[0].upper() + s[1:]
    return s + rng.choice([".", ".", "!", "?", "...", " Dr. Smith agreed.", " e.g. this.", " It costs 3.5 dollars."])


def paragraph(rng, n=None, **kw):
    return " ".join(sentence(rng, **kw) for _ in range(n or rng.randint(1, 4)))


def response(rng, iid, kwargs):
    """A response that follows the instruction about half the time, near its boundary."""
    k = rng.random()
    body = paragraph(rng)
    if iid == "keywords:existence":
        return body + (" " + " ".join(kwargs["keywords"]) if k < 0.4 else "") + (" " + kwargs["keywords"][0] + "s" if k > 0.7 else "")
    if iid == "keywords:frequency":
        return body + (" " + kwargs["keyword"].upper()) * rng.randint(0, kwargs["frequency"] + 1)
    if iid == "keywords:forbidden_words":
        return body + (" " + rng.choice(kwargs["forbidden_words"]) + rng.choice(["", "s", "."]) if k < 0.6 else "")
    if iid == "keywords:letter_frequency":
        return body + " " + kwargs["letter"].upper() * rng.randint(0, 6)
    if iid == "language:response_language":
        lang = kwargs["language"] if k < 0.5 else rng.choice(list(LANG_TEXT))
        return LANG_TEXT[lang] + (" " + LANG_TEXT["en"] if k > 0.9 else "")
    if iid == "length_constraints:number_sentences":
        return paragraph(rng, n=rng.randint(1, 6)) + ("\n" + paragraph(rng, n=1) if k < 0.3 else "")
    if iid in ("length_constraints:number_paragraphs", "length_constraints:nth_paragraph_first_word"):
        n = rng.randint(1, 4)
        sep = "\n\n" if iid.endswith("first_word") else rng.choice(["\n\n***\n\n", " *** ", "***"])
        paras = [paragraph(rng) for _ in range(n)]
        if iid.endswith("first_word") and k < 0.6:
            i = min(kwargs["nth_paragraph"], n) - 1
            paras[i] = rng.choice(['"', "'", ""]) + kwargs["first_word"].capitalize() + rng.choice([",", ".", ""]) + " " + paras[i]
        text = sep.join(paras)
        return text + (sep if k > 0.85 else "")
    if iid == "length_constraints:number_words":
        return " ".join(rng.choice(WORDS) for _ in range(kwargs["num_words"] + rng.randint(-3, 3)))
    if iid == "detectable_content:number_placeholders":
        return body + "".join(f" [{rng.choice(WORDS)}]" for _ in range(kwargs["num_placeholders"] + rng.randint(-1, 1)))
    if iid == "detectable_content:postscript":
        marker = rng.choice([kwargs["postscript_marker"], "P.S.", "PS", "p. s.", "P.P.S"])
        return body + (f"\n\n{marker} " + sentence(rng) if k < 0.7 else "")
    if iid == "detectable_format:number_bullet_lists":
        items = [rng.choice(["* ", "- ", "*", "** ", "  - "]) + sentence(rng) for _ in range(rng.randint(1, 5))]
        return body + "\n" + "\n".join(items)
    if iid == "detectable_format:constrained_response":
        return rng.choice(["My answer is yes.", "My answer is no", "my answer is maybe.", "Maybe. My answer is maybe."])
    if iid == "detectable_format:number_highlighted_sections":
        marks = [rng.choice(["*", "**"]) for _ in range(rng.randint(0, 4))]
        return body + "".join(f" {m}{rng.choice(WORDS + [' '])}{m}" for m in marks)
    if iid == "detectable_format:multiple_sections":
        spl = kwargs["section_spliter"]
        n = rng.randint(1, 4)
        return "\n".join(f"{rng.choice([spl, spl.upper(), spl.lower()])} {i + 1}\n{paragraph(rng)}" for i in range(n))
    if iid == "detectable_format:json_format":
        return rng.choice(['{"a": 1}', '```json\n{"a": [1, 2]}\n```', "```\n[1, 2]\n```", "{a: 1}", '```JSON\n{"x": "y"}```',
                           "Here: {\"a\": 1}", body])
    if iid == "detectable_format:title":
        return rng.choice([f"<<{rng.choice(WORDS)}>>\n", f"<<{rng.choice(WORDS)} {rng.choice(WORDS)}>>\n", "<< >>\n", "<<\n>>"]) + body
    if iid == "combination:two_responses":
        a, b = paragraph(rng), paragraph(rng)
        return rng.choice([f"{a}\n******\n{b}", f"{a}\n******\n{a}", f"{a}******{b}******", f"{a}\n******\n\n******\n{b}", a])
    if iid == "combination:repeat_prompt":
        return (kwargs["prompt_to_repeat"] if k < 0.6 else paragraph(rng)) + " " + body
    if iid == "startend:end_checker":
        return body + (" " + kwargs["end_phrase"] + rng.choice(["", '"', " ", "!"]) if k < 0.6 else "")
    if iid == "startend:quotation":
        return rng.choice(['"', '"', "", "'"]) + body + rng.choice(['"', '"', "", '" '])
    if iid == "change_case:capital_word_frequency":
        return " ".join(w.upper() if rng.random() < 0.5 else w for w in (body + " DON'T WELL-KNOWN U.S. it's").split())
    if iid == "change_case:english_capital":
        return rng.choice([LANG_TEXT["en"].upper(), LANG_TEXT["en"].upper() + " " + paragraph(rng, caps=True), body,
                           LANG_TEXT["en"], LANG_TEXT["fr"].upper(), "123 456"])
    if iid == "change_case:english_lowercase":
        return rng.choice([body.lower(), body, LANG_TEXT["de"].lower(), LANG_TEXT["en"].lower()])
    if iid == "punctuation:no_comma":
        return paragraph(rng, comma=k < 0.5)
    raise AssertionError(iid)


def kwargs_for(rng, iid):
    rel = rng.choice(["less than", "at least"])
    n = rng.randint(1, 5)
    return {
        "keywords:existence": lambda: {"keywords": rng.sample(KEYWORDS, rng.randint(1, 2))},
        "keywords:frequency": lambda: {"keyword": rng.choice(WORDS), "frequency": n, "relation": rel},
        "keywords:forbidden_words": lambda: {"forbidden_words": rng.sample(KEYWORDS, 2)},
        "keywords:letter_frequency": lambda: {"letter": rng.choice("aeiorstz"), "let_frequency": rng.randint(3, 20),
                                              "let_relation": rel},
        "language:response_language": lambda: {"language": rng.choice(["en", "fr", "de", "ru", "ja", "ko"])},
        "length_constraints:number_sentences": lambda: {"num_sentences": n, "relation": rel},
        "length_constraints:number_paragraphs": lambda: {"num_paragraphs": rng.randint(1, 4)},
        "length_constraints:number_words": lambda: {"num_words": rng.randint(5, 40), "relation": rel},
        "length_constraints:nth_paragraph_first_word": lambda: (lambda p: {
            "num_paragraphs": p, "nth_paragraph": rng.randint(1, p), "first_word": rng.choice(WORDS)})(rng.randint(1, 4)),
        "detectable_content:number_placeholders": lambda: {"num_placeholders": n},
        "detectable_content:postscript": lambda: {"postscript_marker": rng.choice(["P.S.", "P.P.S", "Note:"])},
        "detectable_format:number_bullet_lists": lambda: {"num_bullets": n},
        "detectable_format:number_highlighted_sections": lambda: {"num_highlights": n},
        "detectable_format:multiple_sections": lambda: {"section_spliter": rng.choice(["Section", "SECTION", "Part"]),
                                                        "num_sections": n},
        "combination:repeat_prompt": lambda: {"prompt_to_repeat": paragraph(rng, n=1)},
        "startend:end_checker": lambda: {"end_phrase": rng.choice(["Any other questions?", "That is all."])},
        "change_case:capital_word_frequency": lambda: {"capital_frequency": rng.randint(2, 10),
                                                       "capital_relation": rel},
    }.get(iid, dict)()


def triples(n_per_id: int, seed: int):
    rng = random.Random(seed)
    for iid in REFERENCE_IDS:
        for _ in range(n_per_id):
            kw = kwargs_for(rng, iid)
            yield iid, kw, response(rng, iid, kw)


# ---- edge cases of the ids whose verdict turns on small details ------------------------------
EDGE_IDS = ("length_constraints:nth_paragraph_first_word", "detectable_format:constrained_response",
            "combination:two_responses", "combination:repeat_prompt", "change_case:capital_word_frequency")
# tokens whose Treebank split decides what counts as an all-capital word
CAPITAL_PIECES = ("NASA OK I A DON'T CAN'T WON'T I'M IT'S JOHN'S JAMES' CANNOT GONNA WANNA GIMME D'YE MORE'N 'TWAS "
                  "'TIS 'EM AND/OR WELL-KNOWN X-RAY U.S. U.S.A. PH.D. COVID-19 3D MP3 A&B ROCK''N ÉCOLE ΣΩ ЖЩ ǅ "
                  "N'T n't 'S 'LL the river Calm x 5 3,5 10:30 Dr. Mr. e.g. Inc. www.x.com").split()
PUNCT = (". ", "... ", ".", ", ", ",", "; ", "! ", "?", ": ", ":", " - ", "--", " -- ", " (", ") ", "[", "]", ' "', '" ',
         " '", "' ", "''", "“", "” ", "’", "‘", "«", "»", " *", "&", "$", "#", "@", "`", "—", "/", " ", "  ", "\n", "\n\n")


def capital_text(rng) -> str:
    return "".join(rng.choice(CAPITAL_PIECES) + rng.choice(PUNCT) for _ in range(rng.randint(1, 14)))


def edge_response(rng, iid, kwargs):
    if iid == "length_constraints:nth_paragraph_first_word":
        w = kwargs["first_word"]
        paras = [paragraph(rng) for _ in range(max(1, kwargs["num_paragraphs"] + rng.choice([-1, 0, 0, 0, 1])))]
        opener = rng.choice(["{W}", "{w}", "{U}", '"{W}', "'{W}", "{W},", "{W}.", "{W}'s", "{W}-like", "{W}s", "**{W}**",
                             "({W}", "{W}!", "{W}:", "Other"])
        i = min(kwargs["nth_paragraph"], len(paras)) - 1
        paras[i] = opener.format(W=w.capitalize(), w=w, U=w.upper()) + rng.choice([" ", "\n", ""]) + paras[i]
        sep = rng.choice(["\n\n", "\n\n", "\n\n", "\n\n\n", "\n \n", "\n"])
        return rng.choice(["", "", "", "\n\n"]) + sep.join(paras) + rng.choice(["", "", "\n\n", "\n\n\n\n"])
    if iid == "detectable_format:constrained_response":
        option = rng.choice(["My answer is yes.", "My answer is no.", "My answer is maybe.", "my answer is yes.",
                             "My answer is no", "My Answer is maybe.", "My answer is yes!", "My  answer is no.",
                             "My answer is yes..", "\u201cMy answer is no.\u201d", "**My answer is maybe.**"])
        before = rng.choice(["", "", "Pikachu is not an Avenger. ", "Let me think.\n\n", "  "])
        return before + option + rng.choice(["", "", " It is clear.", "\n", " My answer is no.", "**"])
    if iid == "combination:two_responses":
        a = paragraph(rng)
        b = rng.choice([paragraph(rng), paragraph(rng), a, " " + a + "  ", a.upper(), ""])
        sep = rng.choice(["\n******\n", "******", " ****** ", "\n*******\n", "\n*****\n", "\n******\n******\n",
                          "\n****** ******\n"])
        tail = rng.choice(["", "", "\n******", "\n******\n" + paragraph(rng)])
        return rng.choice(["", "", "******\n", "\n"]) + a + sep + b + tail
    if iid == "combination:repeat_prompt":
        p = kwargs["prompt_to_repeat"]
        head = rng.choice([p, p, p, p.lower(), p.upper(), p[:-2], " \n" + p, "Sure! " + p, p.replace(" ", "  ", 1)])
        return head + rng.choice([" ", "\n", "", "\n\n"]) + rng.choice([paragraph(rng), paragraph(rng), "", p])
    if iid == "change_case:capital_word_frequency":
        return capital_text(rng)
    raise AssertionError(iid)


def edge_triples(n_per_id: int, seed: int):
    rng = random.Random(seed)
    for iid in EDGE_IDS:
        for _ in range(n_per_id):
            kw = kwargs_for(rng, iid)
            if iid == "combination:repeat_prompt":
                kw = {"prompt_to_repeat": rng.choice(["", " ", "\n"]) + kw["prompt_to_repeat"] + rng.choice(["", " "])}
            text = edge_response(rng, iid, kw)
            if iid == "change_case:capital_word_frequency":  # a frequency at the text's boundary
                n = sum(w.isupper() for w in words_treebank(text))
                kw = {**kw, "capital_frequency": max(1, n + rng.choice([-1, 0, 1]))}
            yield iid, kw, text


def test_all_25_reference_instruction_ids_are_implemented(reference):
    assert set(reference["instructions_registry"].INSTRUCTION_DICT) == set(REFERENCE_IDS)
    assert len(REFERENCE_IDS) == 25


def test_agreement_with_the_reference(reference):
    total, disagreements, followed_count = 0, [], 0
    for iid, kw, text in triples(n_per_id=14, seed=7):
        for mode in ("strict", "loose"):
            ours = followed(text, INSTRUCTIONS[iid], kw, mode)
            theirs = reference_followed(reference, iid, kw, text, mode)
            total += 1
            followed_count += theirs
            if ours != theirs:
                disagreements.append((iid, mode, kw, text[:200], ours, theirs))
    assert total >= 600
    assert 0.25 < followed_count / total < 0.75  # the cases sit on both sides of each instruction
    assert 1 - len(disagreements) / total >= 0.99, disagreements[:10]


def test_ifeval_dataset_rows_verify_directly():
    row = {"domain": "ifeval", "reference": {
        "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
        "kwargs": [{}, {"relation": "less than", "num_words": 8, "keyword": None}]}}
    assert verify(row, "A short answer without commas").score == 1
    assert verify(row, "A short answer, with a comma").score == 0
    bad = verify({"domain": "ifeval", "reference": {"instruction_id_list": ["length_constraints:number_words"],
                                                    "kwargs": [{"relation": "less than"}]}}, "hi")
    assert bad.score == 0 and "missing ['num_words']" in bad.reason


def test_agreement_per_id_on_edge_cases(reference):
    per_id: dict[str, list[int]] = {}  # id -> [cases, agreements, followed by the reference]
    disagreements = []
    for iid, kw, text in edge_triples(n_per_id=120, seed=3):
        for mode in ("strict", "loose"):
            ours = followed(text, INSTRUCTIONS[iid], kw, mode)
            theirs = reference_followed(reference, iid, kw, text, mode)
            stats = per_id.setdefault(iid, [0, 0, 0])
            stats[0], stats[1], stats[2] = stats[0] + 1, stats[1] + (ours == theirs), stats[2] + theirs
            if ours != theirs:
                disagreements.append((iid, mode, kw, text[:200], ours, theirs))
    assert set(per_id) == set(EDGE_IDS)
    for iid, (n, agreed, yes) in per_id.items():
        assert agreed / n >= 0.99, (iid, f"{agreed}/{n}", [d for d in disagreements if d[0] == iid][:5])
        assert 0.15 < yes / n < 0.85, (iid, f"{yes}/{n} followed: the cases must sit on both sides")


def test_treebank_capital_words_match_nltk_per_sentence(reference):
    rng = random.Random(5)
    for _ in range(1500):
        text = capital_text(rng)
        assert sum(w.isupper() for w in words_treebank(text)) == reference_capital_words(reference, text), (
            text, words_treebank(text))
