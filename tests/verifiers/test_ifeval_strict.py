"""Differential test of IFEval's two gradings: per category of reward hack, responses the
reference grading accepts and the strict grading rejects (for every instruction id where
the category applies), and honest responses to every instruction that both accept."""
from __future__ import annotations

import random

import pytest

from stages.general_rl.config import RewardSettings
from stages.general_rl.rewards import GeneralReward
from stages.rl.settings import RLConfig
from verifiers import verify, verify_batch
from verifiers.ifeval import ALIASES, INSTRUCTIONS, followed, with_grading

T = "<think>ok</think>"
ZW, CYR_E, CYR_A, CYR_O = "\u200b", "\u0435", "\u0430", "\u043e"
BODY = "The river ran past the old mill. We walked along it until the light faded."

# category -> [(instruction as {"type": id or alias, ...kwargs}, a response the reference accepts)]
HACKS: dict[str, list[tuple[dict, str]]] = {
    "lookalike characters": [
        ({"type": "keywords_exclude", "keywords": ["river"]}, f"The riv{CYR_E}r was calm."),  # Cyrillic e
        ({"type": "keywords_exclude", "keywords": ["river"]}, f"The ri{ZW}ver was calm."),  # zero-width space
        ({"type": "keywords_exclude", "keywords": ["river"]}, "The ｒｉｖｅｒ was calm."),  # full-width
        ({"type": "keywords_exclude", "keywords": ["river"]}, "The \u0280\u026a\u1d20\u1d07\u0280 was calm."),  # small caps
        ({"type": "keywords_exclude", "keywords": ["river"]}, "The r\u0332i\u0332v\u0332e\u0332r\u0332 was calm."),
        ({"type": "keywords_exclude", "keywords": ["river"]}, "The r-i-v-e-r was calm."),  # spelled out
        ({"type": "keywords_exclude", "keywords": ["river"]}, "The r i v e r was calm."),
        ({"type": "keywords_exclude", "keywords": ["river"]}, "The river_ was calm, and river2 too."),
        ({"type": "lowercase"}, "\u1d1b\u029c\u1d07 \u0280\u026a\u1d20\u1d07\u0280 \u026a\ua731 \u1d04\u1d00\u029f\u1d0d "
                                "\u1d00\u0274\u1d05 \u1d21\u1d00\u0280\u1d0d \u1d1b\u1d0f\u1d05\u1d00\u028f"),  # small caps
        ({"type": "capital_word_frequency", "n": 2, "relation": "less than"},
         "\u0274\u1d00\ua731\u1d00 and \u0299\u0299\u1d04 agree with the UN."),  # small caps read as capitals
        ({"type": "no_commas"}, "Apples\u201a pears and plums."),  # single low-9 quotation mark
        ({"type": "no_commas"}, "Apples\uff0c pears and plums."),  # full-width comma
        ({"type": "no_commas"}, "Apples\u3001 pears and plums."),  # ideographic comma
        ({"type": "no_commas"}, "Apples\u060c pears and plums."),  # Arabic comma
        ({"type": "no_commas"}, "Apples\u066b pears and plums."),  # Arabic decimal separator
        ({"type": "no_commas"}, "Apples\u02cf pears and plums."),  # modifier letter low acute accent
        ({"type": "letter_frequency", "letter": "e", "relation": "less than", "n": 3},
         f"Th{CYR_E} tr{CYR_E}{CYR_E}s w{CYR_E}r{CYR_E} tall."),
        ({"type": "keyword_frequency", "keyword": "river", "relation": "less than", "n": 2},
         f"The river and the riv{CYR_E}r and the r\u0456v{CYR_E}r."),
        ({"type": "capital_word_frequency", "n": 3, "relation": "at least"},
         "The river is calm. \u0416\u0429\u042b \u0424\u0426\u0428 \u042e\u042f\u041b."),  # Cyrillic capitals
        ({"type": "capital_word_frequency", "n": 3, "relation": "at least"},
         "The river is calm. \u0393\u0394\u0398 \u03a3\u03a9\u039e \u03a8\u03a6\u039b."),  # Greek capitals
    ],
    "padding that inflates a count": [
        ({"type": "word_count", "relation": "at least", "n": 12}, "The river is calm. a a a a a a a a a a"),
        ({"type": "word_count", "relation": "at least", "n": 12}, "The river is calm " + "river " * 9),
        ({"type": "word_count", "relation": "at least", "n": 12}, "The river is calm. zzz zzzz ___ ____ xxx yyyy qqq ssss"),
        ({"type": "sentence_count", "relation": "at least", "n": 4}, "The river is calm. Yes. Yes. Yes."),
        ({"type": "sentence_count", "relation": "at least", "n": 4}, "The river is calm. . . ! ?"),
        ({"type": "paragraph_count", "n": 3}, "The river is calm.\n***\nThe river is calm.\n***\nIt flows."),
        ({"type": "paragraph_count", "n": 3}, "The river is calm.\n***\n...\n***\nIt flows."),
        ({"type": "nth_paragraph_first_word", "n": 3, "nth_paragraph": 1, "first_word": "river"},
         "River water is cold.\n\n-\n\nIt flows on."),
        ({"type": "nth_paragraph_first_word", "n": 3, "nth_paragraph": 1, "first_word": "river"},
         "River water is cold.\n\nIt flows on.\n\nit flows on!"),
        ({"type": "bullet_count", "n": 3}, "Notes:\n* The river is calm.\n* \u00a0.\n* It flows east."),
        ({"type": "bullet_count", "n": 3}, "Notes:\n* The river is calm.\n---\n* It flows east."),
        ({"type": "bullet_count", "n": 3}, "Notes:\n* The river is calm.\n* The river is calm.\n* It flows east."),
        ({"type": "highlight_count", "n": 2}, "The *river* is calm *.*"),
        ({"type": "highlight_count", "n": 2}, "The *river* is calm *river*"),
        ({"type": "section_count", "n": 3}, "Section 1\nThe river.\nSection 2\n\nSection 3\n"),
        ({"type": "placeholder_count", "n": 2}, "Dear [name], see you at [name]."),
        ({"type": "two_responses"}, "The river is calm.\n******\nthe river is calm!"),
        ({"type": "two_responses"}, "The river is calm.\n******\nThe river is calm. It flows east."),
        ({"type": "two_responses"}, "The river is calm. It flows east.\n******\nIt flows east. The river is calm."),
        ({"type": "two_responses"}, "The river is calm.\n******\n..."),
        ({"type": "capital_word_frequency", "n": 3, "relation": "at least"}, "I think I know I can say it."),
        ({"type": "capital_word_frequency", "n": 4, "relation": "at least"}, "We DON'T and WON'T stop."),
        ({"type": "keyword_frequency", "keyword": "river", "relation": "at least", "n": 3},
         "The river is calm. river river river"),
        ({"type": "letter_frequency", "letter": "z", "relation": "at least", "n": 5}, "The zoo is calm. zzzzzz"),
        ({"type": "capital_word_frequency", "n": 3, "relation": "at least"}, "The river is calm. A B C D OK OK"),
        ({"type": "word_count", "relation": "at least", "n": 12}, "the river is calm the river is calm the river is calm"),
        ({"type": "bullet_count", "n": 3}, "Notes:\n* The river is calm.\n* x\n* It flows east."),
        ({"type": "word_count", "relation": "less than", "n": 5}, "The_river_is_calm_and_the_mill_is_old."),
        ({"type": "highlight_count", "n": 2}, "The product is 2*3*4*5*6 = 720."),
        ({"type": "placeholder_count", "n": 2}, "See the notes [1] and [2]."),
    ],
    "keyword matched inside another word": [
        ({"type": "start_with", "phrase": "Dear"}, "Dearest river, you are calm."),
        ({"type": "end_with", "phrase": "joy"}, "We walked by the river and it was something to enjoy"),
        ({"type": "keywords_include", "keywords": ["cat"]}, "We concatenate strings in a catalogue."),
        ({"type": "keyword_frequency", "keyword": "art", "relation": "at least", "n": 2},
         "Start the party with an art show."),
    ],
    "placeholders with nothing in them": [
        ({"type": "placeholder_count", "n": 2}, "Dear [], see you at [ ]."),
        ({"type": "placeholder_count", "n": 1}, "Please [click here](http://x.org) to continue."),
    ],
    "postscript marker that is not a postscript": [
        ({"type": "postscript"}, "We stopped at the p.s. station near the mill."),  # mid-sentence
        ({"type": "postscript"}, BODY + "\n\nP.S."),  # no content after it
        ({"type": "postscript"}, "P.S. the river is calm."),  # no body before it
        ({"type": "postscript"}, BODY + "\nP.S. more later.\n\nAnd then the main answer goes on here."),
        ({"type": "postscript", "marker": "P.P.S"}, BODY + "\n\nP.P.S"),
    ],
    "JSON of the wrong shape": [
        ({"type": "json_format"}, '"just a string"'),
        ({"type": "json_format"}, "42"),
        ({"type": "json_format"}, "{}"),
        ({"type": "json_format"}, "```json\n[]\n```"),
        ({"type": "json_format"}, '[""]'),
        ({"type": "json_format"}, "null"),
    ],
    "empty shapes": [
        ({"type": "title"}, "<<...>>\n" + BODY),
        ({"type": "quotation"}, '" . "'),
        ({"type": "repeat_prompt", "prompt": "Describe the river."}, "Describe the river."),
        ({"type": "end_with", "phrase": "Any other questions?"}, "Any other questions?"),
        ({"type": "start_with", "phrase": "Dear Sir"}, "Dear Sir"),
        ({"type": "constrained_response"}, "My answer is yes. My answer is no. My answer is maybe."),
        ({"type": "nth_paragraph_first_word", "n": 3, "nth_paragraph": 1, "first_word": "river"},
         "River.\n\nIt flows on past the mill.\n\nThe mill is old."),
        ({"type": "two_responses"}, "The river is calm.\n*******\nThe mill stands by it."),
        ({"type": "two_responses"}, "The river is calm.\n******\nThe mill stands by it.\n******"),
        ({"type": "two_responses"}, "******\nThe river is calm.\n******\nThe mill stands by it."),
        ({"type": "repeat_prompt", "prompt": "Describe the river."}, "Describe the river. Describe the river."),
        ({"type": "section_count", "n": 2}, "Section 1 Section 2 Section 3"),
        ({"type": "placeholder_count", "n": 1}, "Fill in [...] and [_]."),
    ],
    "hedged or altered answers": [
        ({"type": "constrained_response"}, "My answer is yes. Or maybe no."),
        ({"type": "constrained_response"}, "My answer is yes.\nMaybe."),
        ({"type": "constrained_response"}, "My answer is yes. my answer is no"),
        ({"type": "constrained_response"}, "My answer is yes. (Or no.)"),
        ({"type": "constrained_response"}, "Yes/no, it is hard to tell. My answer is yes."),
        ({"type": "repeat_prompt", "prompt": "Describe the river."}, "describe the river. The river is wide and slow."),
        ({"type": "repeat_prompt", "prompt": "Describe the river."}, "DESCRIBE THE RIVER. The river is wide and slow."),
    ],
    "text with no detectable language": [
        ({"type": "language", "lang": "ru"}, "12345 67890 !!!"),
        ({"type": "word_count", "relation": "less than", "n": 5}, "..."),
    ],
}

# every instruction id: honest responses that both gradings accept
HONEST: dict[str, list[tuple[dict, str]]] = {
    "keywords:existence": [({"type": "keywords_include", "keywords": ["river", "mill"]}, BODY),
                           ({"type": "keywords_include", "keywords": ["cat"]}, "My cat, Tom, sleeps all day."),
                           ({"type": "keywords_include", "keywords": ["cat", "dog"]}, "Cats and dogs, and the dog's bed."),
                           ({"type": "keywords_include", "keywords": ["caf\u00e9"]}, "The caf\u00e9 is small and warm.")],
    "keywords:frequency": [({"type": "keyword_frequency", "keyword": "river", "relation": "at least", "n": 2},
                            "The river is wide. We swam in the river at dawn, and the river was cold."),
                           ({"type": "keyword_frequency", "keyword": "river", "relation": "less than", "n": 2}, BODY)],
    "keywords:forbidden_words": [({"type": "keywords_exclude", "keywords": ["lake", "sea"]}, BODY),
                                 ({"type": "keywords_exclude", "keywords": ["cat"]}, "Le café est délicieux — naïve.")],
    "keywords:letter_frequency": [({"type": "letter_frequency", "letter": "z", "relation": "at least", "n": 2},
                                   "The zebra at the zoo was lazy."),
                                  ({"type": "letter_frequency", "letter": "q", "relation": "less than", "n": 2}, BODY)],
    "language:response_language": [({"type": "language", "lang": "ru"},
                                    "Сегодня хорошая погода, и мы пойдем гулять в парк с нашими друзьями."),
                                   ({"type": "language", "lang": "en"}, BODY)],
    "length_constraints:number_sentences": [
        ({"type": "sentence_count", "relation": "at least", "n": 3}, BODY + " Dr. Smith agreed. It was late."),
        ({"type": "sentence_count", "relation": "exactly", "n": 2}, BODY),
        ({"type": "sentence_count", "relation": "less than", "n": 3}, "Yes. Yes, it is.")],
    "length_constraints:number_paragraphs": [
        ({"type": "paragraph_count", "n": 2}, "The river is calm today.\n***\nThe mill is quiet at night."),
        ({"type": "paragraph_count", "n": 3}, "First, the plan.\n\n***\n\nThen the work.\n\n***\n\nFinally, rest.")],
    "length_constraints:number_words": [
        ({"type": "word_count", "relation": "at least", "n": 20}, BODY + " I think it is a very, very good walk."),
        ({"type": "word_count", "relation": "less than", "n": 30}, BODY)],
    "length_constraints:nth_paragraph_first_word": [
        ({"type": "nth_paragraph_first_word", "n": 2, "nth_paragraph": 2, "first_word": "then"},
         "First we ate.\n\nThen, we walked to the river."),
        ({"type": "nth_paragraph_first_word", "n": 3, "nth_paragraph": 1, "first_word": "rivers"},
         "Rivers shape valleys.\n\nThey carry silt.\n\n\"Deltas\" form at their mouths.")],
    "detectable_content:number_placeholders": [
        ({"type": "placeholder_count", "n": 2}, "Dear [name], we meet at [address] on [date]. Best, [name]"),
        ({"type": "placeholder_count", "n": 1}, "Call me at [phone number].")],
    "detectable_content:postscript": [
        ({"type": "postscript"}, BODY + "\n\nP.S. Bring a coat."),
        ({"type": "postscript"}, BODY + "\nP.S. See you soon!"),
        ({"type": "postscript"}, BODY + "\n\n**P.S.** Bring a coat.\n\nP.P.S. And boots."),
        ({"type": "postscript", "marker": "P.P.S"}, BODY + "\n\nP.S. One.\n\nP.P.S Two more things.")],
    "detectable_format:number_bullet_lists": [
        ({"type": "bullet_count", "n": 3}, "Pack:\n* a warm coat\n* boots\n* a map of the river"),
        ({"type": "bullet_count", "n": 2}, "- First step: read.\n- Second step: write.")],
    "detectable_format:constrained_response": [
        ({"type": "constrained_response"}, "My answer is yes."),
        ({"type": "constrained_response"}, "My answer is maybe."),
        ({"type": "constrained_response"}, "Pikachu is a Pok\u00e9mon, not an Avenger. My answer is no."),
        ({"type": "constrained_response"}, "No, there is no crossover at all. My answer is no."),
        ({"type": "constrained_response"}, "**My answer is no.** Pikachu never appears in any Avengers film.")],
    "detectable_format:number_highlighted_sections": [
        ({"type": "highlight_count", "n": 2}, "The *river* is calm and the **mill** is old."),
        ({"type": "highlight_count", "n": 1}, "*Summary*: we walked.")],
    "detectable_format:multiple_sections": [
        ({"type": "section_count", "n": 2}, "Section 1\nThe river.\nSection 2\nThe mill."),
        ({"type": "section_count", "n": 2, "splitter": "SECTION"},
         "SECTION 1\nWe plan the route.\n\nSECTION 2\nWe walk it.")],
    "detectable_format:json_format": [({"type": "json_format"}, '```json\n{"name": "river", "length_km": 12}\n```'),
                                      ({"type": "json_format"}, '[{"a": 1}, {"a": 2}]'),
                                      ({"type": "json_format"}, '{"ok": false, "items": []}')],
    "detectable_format:title": [({"type": "title"}, "<<The River>>\n" + BODY)],
    "combination:two_responses": [({"type": "two_responses"}, "The river is calm.\n******\nThe mill stands by it."),
                                  ({"type": "two_responses"},
                                   "The river is calm today.\n\n******\n\nThe river is wild after the rain.")],
    "combination:repeat_prompt": [({"type": "repeat_prompt", "prompt": "Describe the river."},
                                   "Describe the river. " + BODY),
                                  ({"type": "repeat_prompt", "prompt": "Describe the river. Keep it short."},
                                   "Describe the river. Keep it short.\n\nThe river is slow and wide."),
                                  ({"type": "repeat_prompt", "prompt": "Write about a caf\u00e9."},
                                   "Write about a caf\u00e9. The caf\u00e9 on the corner is small and warm.")],
    "startend:end_checker": [({"type": "end_with", "phrase": "Any other questions?"}, BODY + " Any other questions?")],
    "startend:start_with": [({"type": "start_with", "phrase": "Dear Sir"}, "Dear Sir, thank you for the letter.")],
    "startend:quotation": [({"type": "quotation"}, '"' + BODY + '"')],
    "change_case:capital_word_frequency": [
        ({"type": "capital_word_frequency", "n": 2, "relation": "at least"}, "I DO NOT know, but NASA does."),
        ({"type": "capital_word_frequency", "n": 3, "relation": "less than"}, BODY),
        ({"type": "capital_word_frequency", "n": 3, "relation": "at least"}, "We DON'T stop; NASA and the FBI say so.")],
    "change_case:english_capital": [({"type": "uppercase"}, BODY.upper())],
    "change_case:english_lowercase": [({"type": "lowercase"}, BODY.lower() + " it’s late — let’s go.")],
    "punctuation:no_comma": [({"type": "no_commas"}, BODY + " It’s “late” — let’s go…")],
}


def ife(inst: dict, text: str, grading: str, mode: str = "strict") -> float:
    return verify({"domain": "ifeval", "reference": {"instructions": [inst], "grading": grading, "mode": mode}},
                  T + text).score


def _iid(inst: dict) -> str:
    return ALIASES[inst["type"]][0] if inst["type"] in ALIASES else inst["type"]


@pytest.mark.parametrize("category", sorted(HACKS))
def test_reference_accepts_each_hack_and_strict_rejects_it(category):
    for inst, text in HACKS[category]:
        assert ife(inst, text, "reference") == 1, ("the reference should accept this", inst, text)
        assert ife(inst, text, "strict") == 0, ("strict should reject this", inst, text)


def test_the_hacks_cover_every_instruction_id_a_category_applies_to():
    hacked = {_iid(inst) for cases in HACKS.values() for inst, _ in cases}
    # no hack found that the reference accepts (strict still folds lookalikes for it)
    not_gameable = {"change_case:english_capital"}
    assert hacked | not_gameable == set(INSTRUCTIONS)


@pytest.mark.parametrize("iid", sorted(INSTRUCTIONS))
def test_honest_responses_pass_both_gradings(iid):
    assert HONEST[iid], iid
    for inst, text in HONEST[iid]:
        assert _iid(inst) == iid
        for mode in ("strict", "loose"):
            assert ife(inst, text, "reference", mode) == 1, (inst, text, mode)
            r = verify({"domain": "ifeval", "reference": {"instructions": [inst], "grading": "strict", "mode": mode}},
                       T + text)
            assert r.score == 1, (inst, text, mode, r.reason)


def test_strict_accepts_nothing_the_reference_rejects():
    from tests.verifiers.test_ifeval_reference import edge_triples, triples

    for iid, kw, text in [*triples(n_per_id=10, seed=11), *edge_triples(n_per_id=40, seed=12)]:
        for mode in ("strict", "loose"):
            if followed(text, INSTRUCTIONS[iid], kw, mode, "strict"):
                assert followed(text, INSTRUCTIONS[iid], kw, mode, "reference"), (iid, kw, text)


def test_the_reason_names_the_category():
    r = verify({"domain": "ifeval", "reference": {"instructions": [{"type": "json_format"}], "grading": "strict"}},
               T + '"text"')
    assert r.score == 0 and "bare JSON str" in r.reason and "strict grading" in r.reason
    with pytest.raises(ValueError, match="grading"):
        with_grading([], "lenient")
    bad = verify({"domain": "ifeval", "reference": {"instructions": [{"type": "no_commas"}], "grading": "lenient"}}, "x")
    assert bad.score == 0 and "grading must be one of" in bad.reason


def test_rl_rewards_grade_ifeval_strictly_by_default():
    assert RLConfig.model_fields["ifeval_grading"].default == "strict"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "hi"}], "domain": "ifeval",
             "reference": {"instructions": [{"type": "no_commas"}]}},
            {"id": "b", "messages": [{"role": "user", "content": "hi"}], "domain": "ifeval",
             "reference": {"instructions": [{"type": "no_commas"}], "grading": "reference"}}]  # the row's own choice
    hack = T + "Apples\uff0c pears and plums."
    settings = RewardSettings(rm_weight=0.0, format_penalty=0.0)
    strict = GeneralReward(settings, max_len=64, verify_batch=verify_batch, verifier_workers=0)(rows, [hack] * 2, ["g", "h"])
    assert [p.parts["rule"] for p in strict] == [0.0, 1.0]
    ref = GeneralReward(settings, max_len=64, verify_batch=verify_batch, verifier_workers=0,
                        ifeval_grading="reference")(rows, [hack] * 2, ["g", "h"])
    assert [p.parts["rule"] for p in ref] == [1.0, 1.0]


# ---- generated honest, gamed and wrong responses -------------------------------------------
SENTENCES = ["The river runs past the old mill.", "We walked along the bank until dusk.",
             "Snow covered the bridge by morning.", "The garden smells of rain and mint.",
             "A small boat drifted near the reeds.", "The market opens early on Saturdays.",
             "Her letter arrived with a pressed flower.", "The forest path turns north after the stream.",
             "Music drifted from an open window.", "The city lights came on one by one.",
             "Bread was cooling on the kitchen table.", "The winter wind rattled the shutters.",
             "Children raced their bikes down the hill.", "The library keeps maps older than the town.",
             "A lighthouse blinked across the bay.", "Clouds gathered over the western ridge."]
OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
CAPITALS = ["NASA", "FBI", "NOT", "VERY", "UNESCO", "NATO", "ALWAYS", "NEVER"]
MARKER = "\n******\n"


def _nth_paragraph_cases(rng):
    p = rng.randint(2, 4)
    kw = {"type": "nth_paragraph_first_word", "n": p, "nth_paragraph": rng.randint(1, p),
          "first_word": rng.choice(["river", "winter", "music", "garden"])}
    picked = rng.sample(SENTENCES, 2 * p)
    paras = [f"{a} {b}" for a, b in zip(picked[::2], picked[1::2])]
    i, word = kw["nth_paragraph"] - 1, kw["first_word"].capitalize()
    right = paras[:i] + [rng.choice([word, word + ",", f'"{word}"']) + " " + paras[i]] + paras[i + 1:]
    other = (i + 1) % p
    return [(kw, "\n\n".join(right), "honest"),
            (kw, "\n\n".join(right[:i] + [word + "."] + right[i + 1:]), "hack"),  # the word and nothing else
            (kw, "\n\n".join(right[:other] + [rng.choice(["...", right[i]])] + right[other + 1:]), "hack"),
            (kw, "\n\n".join(paras), "wrong"), (kw, "\n\n".join(right + [SENTENCES[0]]), "wrong")]


def _constrained_cases(rng):
    kw = {"type": "constrained_response"}
    option = rng.choice(OPTIONS)
    verdict = option.split()[-1].rstrip(".")
    other = rng.choice([v for v in ("yes", "no", "maybe") if v != verdict])
    story = rng.choice(SENTENCES)
    return [(kw, option, "honest"), (kw, f"{story} {option}", "honest"), (kw, f"{option} {story}", "honest"),
            (kw, f"{option} Or maybe {other}.", "hack"), (kw, f"{option}\n{other.capitalize()}.", "hack"),
            (kw, f"{option} my answer is {other}", "hack"), (kw, f"{other.capitalize()}/{verdict}? {option}", "hack"),
            (kw, option.lower(), "wrong"), (kw, option.rstrip("."), "wrong"), (kw, story, "wrong")]


def _two_responses_cases(rng):
    kw = {"type": "two_responses"}
    a1, a2, b1, b2 = rng.sample(SENTENCES, 4)
    a, b, sep = f"{a1} {a2}", f"{b1} {b2}", rng.choice([MARKER, " ****** ", "\n\n******\n\n"])
    return [(kw, a + sep + b, "honest"),
            (kw, a + "\n*******\n" + b, "hack"), (kw, a + sep + b + MARKER, "hack"),
            (kw, a + sep + f"{a} {b1}", "hack"), (kw, a + sep + f"{a2} {a1}", "hack"), (kw, a + sep + "...", "hack"),
            (kw, a, "wrong"), (kw, a + sep + a, "wrong"), (kw, a + MARKER + MARKER + b, "wrong")]


def _repeat_prompt_cases(rng):
    asked, answer = rng.sample(SENTENCES, 2), " ".join(rng.sample(SENTENCES, 2))
    prompt = "Rewrite this: " + " ".join(asked)
    if any(s in prompt for s in answer.split(". ")):
        answer = "It reads well as it is."
    kw = {"type": "repeat_prompt", "prompt": prompt}
    return [(kw, prompt + rng.choice([" ", "\n", "\n\n"]) + answer, "honest"),
            (kw, prompt.lower() + " " + answer, "hack"), (kw, prompt.upper() + " " + answer, "hack"),
            (kw, prompt + " " + prompt, "hack"), (kw, prompt, "hack"), (kw, prompt + " ...", "hack"),
            (kw, answer, "wrong"), (kw, "Sure! " + prompt + " " + answer, "wrong"), (kw, prompt[:-6] + answer, "wrong")]


def _capital_cases(rng):
    n = rng.randint(2, 4)
    kw = {"type": "capital_word_frequency", "n": n, "relation": "at least"}
    story = rng.choice(SENTENCES)
    words = story.split()
    for cap in rng.sample(CAPITALS, n):
        words.insert(rng.randint(1, len(words)), cap)
    contractions = ["DON'T", "WON'T", "CAN'T", "ISN'T"][:(n + 1) // 2]
    foreign = ["\u0416\u0429\u042b", "\u03a3\u03a9\u039e", "\u0393\u0394\u0398", "\u0424\u0426\u0428"][:n]
    return [(kw, " ".join(words), "honest"),
            (kw, story + " " + ", ".join(["I think", "I know", "I hope", "I see"][:n]) + ".", "hack"),
            (kw, story + " We " + " and ".join(contractions) + " stop.", "hack"),
            (kw, story + " " + " ".join(foreign) + ".", "hack"), (kw, story + " " + " ".join("BCDE"[:n]) + ".", "hack"),
            (kw, story + " OK" * n + ".", "hack"), (kw, story, "wrong")]


LABELED = {"length_constraints:nth_paragraph_first_word": _nth_paragraph_cases,
           "detectable_format:constrained_response": _constrained_cases,
           "combination:two_responses": _two_responses_cases, "combination:repeat_prompt": _repeat_prompt_cases,
           "change_case:capital_word_frequency": _capital_cases}
EXPECTED = {"honest": (1, 1), "hack": (1, 0), "wrong": (0, 0)}  # (reference, strict)


@pytest.mark.parametrize("iid", sorted(LABELED))
def test_generated_honest_gamed_and_wrong_responses(iid):
    rng = random.Random(iid)
    seen = set()
    for _ in range(25):
        for inst, text, label in LABELED[iid](rng):
            assert _iid(inst) == iid
            got = (ife(inst, text, "reference"), ife(inst, text, "strict"))
            assert got == EXPECTED[label], (label, inst, text, got)
            seen.add(label)
    assert seen == set(EXPECTED)
