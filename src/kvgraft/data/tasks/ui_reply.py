r"""The ``ui-reply`` task: an assistant reply describing a requested screen, prose plus a JSON component tree.

A small analogue of the LoRA study's long structured-output task (measured lengths: ``docs/tasks.md``). A user
asks for a screen with a list of components; the assistant replies with prose (a sentence about the screen, one
bullet per component), a fenced JSON block describing the screen, and a closing sentence::

    prompt  'User: Build a signup form titled "Join us" with a white background, 16 px padding
             and a vertical layout. Include a required "Email" field; ...; and a blue "Sign up"
             button.\nAssistant:'
    answer  ' Here is a signup form titled "Join us". It has a vertical layout, ... and 5
             components:\n- a required "Email" input of type email\n- ...\n```json\n{"type":
             "form", "title": "Join us", "style": {...}, "children": [\n  {...},\n  ...\n]}\n```\n
             The components are listed in the order you asked for.'

The JSON object is ``{"type", "title", "style": {"background", "padding", "layout"}, "children"}``, a child
per component (kinds and props: ``_Component``); every value is in the request or follows from a label.

At most :data:`UI_MAX_TOKENS` tokens of the shipped reference tokenizer (``models/*/tokenizer.json`` or
``KVGRAFT_MODELS_DIR``). ``target`` is the canonical JSON (:func:`canonical_json`: sorted keys, no spaces). A
reply is correct when its last ```json block (or else the text from its first ``{`` to its last ``}``) parses
and its canonical form equals the target: same components in the same order, labels, props and styles
(``true`` != ``1``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvgraft.data.tasks.common import Example, TaskError, TaskSpec, _reference_counter, reference_token_budget

UI_MAX_TOKENS = 500
"""Reference-tokenizer tokens of a ui-reply example at most: prompt + answer + EOS, as
:func:`~kvgraft.data.tasks.encode_example` makes them (the reference models have 512 positions)."""
UI_MIN_COMPONENTS = 3
UI_MAX_COMPONENTS = 10
_UI_TOKENS_PER_CHAR = 0.38
"""Typical tokens per character of ui-reply text; only picks where the exact search starts."""


# --------------------------------------------------------------------------- screens and components

_SCREENS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("signup form", "form", ("Join us", "Create account", "Sign up", "Get started", "Register")),
    ("login form", "form", ("Welcome back", "Log in", "Sign in", "Member login")),
    ("contact form", "form", ("Contact us", "Get in touch", "Say hello", "Write to us")),
    ("settings page", "page", ("Settings", "Preferences", "Account settings", "Options")),
    ("profile card", "card", ("My profile", "About me", "Your profile", "Profile")),
    ("checkout form", "form", ("Checkout", "Payment", "Place order", "Billing")),
    ("feedback form", "form", ("Feedback", "Tell us more", "Rate us", "Your thoughts")),
    ("booking form", "form", ("Book a table", "Reserve a room", "Book now", "Plan a visit")),
    ("search panel", "panel", ("Search", "Find items", "Filter results", "Browse")),
    ("survey form", "form", ("Quick survey", "Survey", "Help us improve", "Questions")),
    ("newsletter box", "card", ("Newsletter", "Stay updated", "Join the list", "News")),
    ("dashboard panel", "panel", ("Dashboard", "Overview", "Stats", "Today")),
)
_COLORS = ("blue", "green", "red", "gray", "black", "orange", "purple", "white")
_BACKGROUNDS = ("white", "light gray", "dark", "cream", "light blue")
_PADDINGS = (8, 12, 16, 20, 24)
_LAYOUTS = ("vertical", "horizontal", "grid")
_INPUTS: Mapping[str, str] = {  # label -> inputType (the fixed rule the model can learn)
    "Email": "email",
    "Password": "password",
    "Name": "text",
    "Full name": "text",
    "Username": "text",
    "Phone": "tel",
    "Age": "number",
    "City": "text",
    "Address": "text",
    "Birthday": "date",
    "Card number": "number",
    "Zip code": "text",
    "Company": "text",
    "Website": "url",
    "Guests": "number",
    "Date": "date",
    "Time": "time",
    "Country code": "text",
    "Quantity": "number",
    "Start date": "date",
}
_TEXTAREAS = ("Message", "Comments", "Bio", "Notes", "Description", "Details", "Question")
_CHECKBOXES = (
    "Remember me",
    "I agree to the terms",
    "Send me updates",
    "Keep me signed in",
    "Subscribe",
    "Show prices",
    "Gift wrap",
)
_SELECTS: Mapping[str, tuple[str, ...]] = {
    "Country": ("France", "Spain", "Italy", "Kenya", "India", "Japan", "Chile"),
    "Size": ("S", "M", "L", "XL"),
    "Color": ("Red", "Green", "Blue", "Black", "White"),
    "Language": ("English", "French", "Spanish", "German"),
    "Topic": ("Sales", "Support", "Billing", "Other"),
    "Sort by": ("Price", "Date", "Name", "Rating"),
    "Room": ("Single", "Double", "Suite"),
}
_RADIOS: Mapping[str, tuple[str, ...]] = {
    "Plan": ("Free", "Pro", "Team"),
    "Delivery": ("Standard", "Express", "Pickup"),
    "Payment": ("Card", "Cash", "Transfer"),
    "Rating": ("1", "2", "3", "4", "5"),
    "Contact by": ("Email", "Phone", "Post"),
}
_SLIDERS: Mapping[str, tuple[tuple[int, int], ...]] = {
    "Volume": ((0, 10), (0, 100)),
    "Price": ((0, 500), (10, 200), (0, 1000)),
    "Brightness": ((0, 100), (10, 90)),
    "Distance": ((1, 50), (0, 20)),
    "Budget": ((100, 5000), (0, 900)),
}
_SWITCHES = ("Dark mode", "Notifications", "Auto save", "Two step login", "Public profile", "Sound")
_BUTTONS = (
    "Submit",
    "Sign up",
    "Log in",
    "Save",
    "Send",
    "Cancel",
    "Continue",
    "Pay now",
    "Search",
    "Book",
    "Next",
    "Reset",
    "Back",
    "Apply",
)
_HEADINGS = ("Welcome", "Your details", "Almost done", "Hello there", "Account", "Step one", "Last step")
_HEADING_SIZES = (16, 18, 20, 24, 28, 32)
_IMAGES = ("Logo", "Avatar", "Banner", "Photo", "Map")
_IMAGE_SIZES = ((40, 40), (64, 64), (120, 60), (200, 100), (300, 150))
_LINKS: Mapping[str, str] = {
    "Forgot password?": "/reset",
    "Terms of use": "/terms",
    "Privacy": "/privacy",
    "Help": "/help",
    "Create an account": "/signup",
    "Back to home": "/",
    "See all": "/all",
}


def _a(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _quote_list(items: Sequence[str], sep: str = ", ") -> str:
    """``a, b and c`` (with ``sep="; "``: ``a; b; and c``, for lists whose items hold commas)."""
    items = list(items)
    if len(items) == 1:
        return items[0]
    return sep.join(items[:-1]) + (" and " if sep == ", " else f"{sep}and ") + items[-1]


@dataclass(frozen=True)
class _Component:
    """One component of a screen: its phrase in the request, its bullet in the reply, its JSON object.

    A child of the screen's JSON object is one of: ``input`` (``props.inputType`` follows from the label by a fixed table,
    e.g. "Email" -> "email"; ``props.required``), ``textarea`` (``props.rows``), ``checkbox``
    (``props.checked``), ``select`` and ``radio`` (``props.options``), ``slider`` (``props.min``,
    ``props.max``), ``switch`` (``props.on``), ``button`` (``style.color``), ``text`` (a heading,
    ``style.size``), ``image`` (``props.width``, ``props.height``), ``link`` (``props.href``) and
    ``row`` (``children``: two or three buttons). The request lists the components separated by
    semicolons, the reply has one bullet per component in the same order. Labels are unique on a screen.
    """

    request: str  # phrase in the user's request
    bullet: str  # the assistant's bullet for it
    spec: dict[str, Any]  # its JSON object
    labels: tuple[str, ...]  # labels it uses (kept unique within one screen)

    @cached_property
    def line(self) -> str:
        """Its line in the reply's JSON block."""
        return json.dumps(self.spec)

    @property
    def chars(self) -> int:
        """About the characters it adds to an example (request, bullet, JSON line, separators)."""
        return len(self.request) + len(self.bullet) + len(self.line) + 10


class _Exhausted(Exception):
    """Every label of a pool is already used on this screen: draw another component."""


def _pick(r: random.Random, pool: Iterable[str], used: set[str]) -> str:
    free = [k for k in pool if k not in used]
    if not free:
        raise _Exhausted
    return r.choice(free)


def _button(r: random.Random, used: set[str]) -> _Component:
    label = _pick(r, _BUTTONS, used)
    color = r.choice(_COLORS)
    return _Component(
        f'{_a(color)} {color} "{label}" button',
        f'{_a(color)} {color} "{label}" button',
        {"type": "button", "label": label, "style": {"color": color}},
        (label,),
    )


def _input(r: random.Random, used: set[str]) -> _Component:
    """An input field, required or optional, of its label's type."""
    label = _pick(r, _INPUTS, used)
    required = r.random() < 0.6
    flag = "required" if required else "optional"
    return _Component(
        f'{_a(flag)} {flag} "{label}" field',
        f'{_a(flag)} {flag} "{label}" input of type {_INPUTS[label]}',
        {"type": "input", "label": label, "props": {"inputType": _INPUTS[label], "required": required}},
        (label,),
    )


def _textarea(r: random.Random, used: set[str]) -> _Component:
    """A text area of two to eight rows."""
    label, rows = _pick(r, _TEXTAREAS, used), r.randint(2, 8)
    return _Component(
        f'a "{label}" text area with {rows} rows',
        f'"{label}", a text area {rows} rows high',
        {"type": "textarea", "label": label, "props": {"rows": rows}},
        (label,),
    )


def _checkbox(r: random.Random, used: set[str]) -> _Component:
    """A checkbox, checked or not."""
    label, checked = _pick(r, _CHECKBOXES, used), r.random() < 0.5
    state = "checked" if checked else "unchecked"
    return _Component(
        f'a "{label}" checkbox, {state}',
        f'a "{label}" checkbox that starts {state}',
        {"type": "checkbox", "label": label, "props": {"checked": checked}},
        (label,),
    )


def _choice(r: random.Random, used: set[str], kind: str) -> _Component:
    """A dropdown (``kind`` "select") or a radio group ("radio") of two to four options."""
    table = _SELECTS if kind == "select" else _RADIOS
    label = _pick(r, table, used)
    pool = table[label]
    options = sorted(r.sample(range(len(pool)), r.randint(2, min(4, len(pool)))))
    opts = [pool[i] for i in options]
    what = "dropdown" if kind == "select" else "radio group"
    return _Component(
        f'a "{label}" {what} with {_quote_list(opts)}',
        f'a "{label}" {what} offering {_quote_list(opts)}',
        {"type": kind, "label": label, "props": {"options": opts}},
        (label,),
    )


def _slider(r: random.Random, used: set[str]) -> _Component:
    """A slider over one of its label's ranges."""
    label = _pick(r, _SLIDERS, used)
    lo, hi = r.choice(_SLIDERS[label])
    return _Component(
        f'a "{label}" slider from {lo} to {hi}',
        f'a "{label}" slider with range {lo} to {hi}',
        {"type": "slider", "label": label, "props": {"min": lo, "max": hi}},
        (label,),
    )


def _switch(r: random.Random, used: set[str]) -> _Component:
    """A switch, on or off."""
    label, on = _pick(r, _SWITCHES, used), r.random() < 0.5
    state = "on" if on else "off"
    return _Component(
        f'a "{label}" switch set {state}',
        f'a "{label}" switch, {state} by default',
        {"type": "switch", "label": label, "props": {"on": on}},
        (label,),
    )


def _heading(r: random.Random, used: set[str]) -> _Component:
    """A heading in one of the sizes."""
    label, size = _pick(r, _HEADINGS, used), r.choice(_HEADING_SIZES)
    return _Component(
        f'a "{label}" heading in size {size}',
        f'the heading "{label}" at size {size}',
        {"type": "text", "label": label, "style": {"size": size}},
        (label,),
    )


def _image(r: random.Random, used: set[str]) -> _Component:
    """An image of one of the sizes."""
    label = _pick(r, _IMAGES, used)
    w, h = r.choice(_IMAGE_SIZES)
    return _Component(
        f'a "{label}" image {w} by {h}',
        f'a "{label}" image of {w} by {h} pixels',
        {"type": "image", "label": label, "props": {"width": w, "height": h}},
        (label,),
    )


def _link(r: random.Random, used: set[str]) -> _Component:
    """A link to its label's address."""
    label = _pick(r, _LINKS, used)
    return _Component(
        f'a "{label}" link to {_LINKS[label]}',
        f'a "{label}" link that opens {_LINKS[label]}',
        {"type": "link", "label": label, "props": {"href": _LINKS[label]}},
        (label,),
    )


def _row(r: random.Random, used: set[str]) -> _Component:
    """A row of two or three buttons."""
    buttons: list[_Component] = []
    inner = set(used)
    for _ in range(r.randint(2, 3)):
        b = _button(r, inner)
        inner.add(b.labels[0])
        buttons.append(b)
    return _Component(
        f"a row with {_quote_list([b.request for b in buttons])}",
        f"a row holding {_quote_list([b.bullet for b in buttons])}",
        {"type": "row", "children": [b.spec for b in buttons]},
        tuple(b.labels[0] for b in buttons),
    )


_KINDS = (
    "input",
    "input",
    "input",
    "textarea",
    "checkbox",
    "select",
    "radio",
    "slider",
    "switch",
    "button",
    "button",
    "text",
    "image",
    "link",
    "row",
)  # drawn uniformly: inputs 3x, buttons 2x as often

_MAKERS: dict[str, Callable[[random.Random, set[str]], _Component]] = {
    "input": _input,
    "textarea": _textarea,
    "checkbox": _checkbox,
    "select": lambda r, used: _choice(r, used, "select"),
    "radio": lambda r, used: _choice(r, used, "radio"),
    "slider": _slider,
    "switch": _switch,
    "button": _button,
    "text": _heading,
    "image": _image,
    "link": _link,
    "row": _row,
}


def _component(r: random.Random, used: set[str]) -> _Component:
    """One component of a random kind (``_KINDS``), its labels kept out of ``used``."""
    return _MAKERS[r.choice(_KINDS)](r, used)


_INTROS = (
    'Here is a {screen} titled "{title}".',
    'Sure. This {screen} is titled "{title}".',
    'Below is a {screen} called "{title}".',
    'Here is the {screen} you asked for, titled "{title}".',
)
_CLOSINGS = (
    "The components are listed in the order you asked for.",
    "You can change any color or size in the style fields.",
    "Each label matches your request, so the JSON can be rendered as is.",
    "Add more children to the list to extend the screen.",
)
_ASKS = ("Build", "Create", "Make", "Design")


def _render_ui(
    screen: str,
    title: str,
    style: dict[str, Any],
    comps: Sequence[_Component],
    ask: str,
    intro: str,
    closing: str,
    spec_type: str,
) -> tuple[str, str, dict[str, Any]]:
    spec = {"type": spec_type, "title": title, "style": style, "children": [c.spec for c in comps]}
    prompt = (
        f'User: {ask} {_a(screen)} {screen} titled "{title}" with a {style["background"]} background, '
        f"{style['padding']} px padding and a {style['layout']} layout. "
        f"Include {_quote_list([c.request for c in comps], '; ')}.\nAssistant:"
    )
    bullets = "\n".join(f"- {c.bullet}" for c in comps)
    head = json.dumps({k: v for k, v in spec.items() if k != "children"})[:-1]
    children = ",\n  ".join(c.line for c in comps)
    block = f'{head}, "children": [\n  {children}\n]}}'
    answer = (
        f" {intro.format(screen=screen, title=title)} It has a {style['layout']} layout, "
        f"a {style['background']} background and {style['padding']} px padding, "
        f"and {len(comps)} components:\n{bullets}\n```json\n{block}\n```\n{closing}"
    )
    return prompt, answer, spec


def canonical_json(obj: Any) -> str:
    """The canonical text of a JSON value: sorted keys, no spaces (the ui-reply ``target``)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------- the token budget


def _ui_example(r: random.Random, count: Callable[[str], int]) -> Example:
    """One example, its tokens counted by ``count``. Components are drawn one after another (at most
    :data:`UI_MAX_COMPONENTS`) and the example keeps the longest run of them (at least
    :data:`UI_MIN_COMPONENTS`) whose prompt + answer + EOS fits :data:`UI_MAX_TOKENS` = 500 tokens of the
    shipped reference tokenizer, counted exactly (the tokenizer's pieces, cached); its output depends on
    that file, which is fixed."""
    while True:  # a screen whose first UI_MIN_COMPONENTS components overflow the budget is drawn again
        ex = _ui_attempt(r, count)
        if ex is not None:
            return ex


def _ui_attempt(
    r: random.Random,
    count: Callable[[str], int],
    max_tokens: int = UI_MAX_TOKENS,
    size: Callable[[str, str], int] | None = None,
) -> Example | None:
    """One screen with the longest run of components that fits ``max_tokens``, or None when even
    UI_MIN_COMPONENTS do not; ``size(prompt, answer)``: an example's tokens (default: prompt + answer + EOS
    by ``count``, the reference models' plain encoding)."""
    screen, spec_type, titles = r.choice(_SCREENS)
    title = r.choice(titles)
    style = {"background": r.choice(_BACKGROUNDS), "padding": r.choice(_PADDINGS), "layout": r.choice(_LAYOUTS)}
    ask, intro, closing = r.choice(_ASKS), r.choice(_INTROS), r.choice(_CLOSINGS)
    comps: list[_Component] = []
    used: set[str] = set()

    def have(k: int) -> bool:  # draw components (lazily, in order) until there are k of them
        for _ in range(100):
            if len(comps) >= k:
                return True
            try:
                comp = _component(r, used)
            except _Exhausted:  # every label of that kind is taken on this screen
                continue
            comps.append(comp)
            used.update(comp.labels)
        return False

    rendered: dict[int, tuple[str, str, dict[str, Any]]] = {}
    tokens: dict[int, int] = {}

    def fits(k: int) -> bool:  # prompt + answer + EOS of the first k components within the budget
        if k not in tokens:
            rendered[k] = _render_ui(screen, title, style, comps[:k], ask, intro, closing, spec_type)
            p, a = rendered[k][0], rendered[k][1]
            tokens[k] = count(p) + count(a) + 1 if size is None else size(p, a)
        return tokens[k] <= max_tokens

    # the longest prefix that fits; tokens grow with k, so walk from a guess made on characters
    if not have(UI_MIN_COMPONENTS):
        return None
    chars = sum(map(len, _render_ui(screen, title, style, comps, ask, intro, closing, spec_type)[:2]))
    k = UI_MIN_COMPONENTS
    while k < UI_MAX_COMPONENTS and have(k + 1) and (chars + comps[k].chars) * _UI_TOKENS_PER_CHAR <= max_tokens:
        chars += comps[k].chars
        k += 1
    if fits(k):
        while k < UI_MAX_COMPONENTS and have(k + 1) and fits(k + 1):
            k += 1
    else:
        while k > UI_MIN_COMPONENTS and not fits(k - 1):
            k -= 1
        k -= 1
        if k < UI_MIN_COMPONENTS:
            return None
    prompt, answer, spec = rendered[k]
    return Example(prompt=prompt, answer=answer, target=canonical_json(spec), kind=screen.replace(" ", "-"))


# --------------------------------------------------------------------------- sized for another model


def sized_ui_example(r: random.Random, sizing: Any) -> Example:
    """One example sized by ``sizing`` (a :class:`~kvgraft.data.tasks.sizing.TaskSizing`): the longest run of
    components whose prompt + answer + end token fits ``max_tokens`` (default 500) in the sizing's encoding
    (the chat template's tokens count too), checked exactly with the tokenizer. With the reference tokenizer,
    the plain format and 500 tokens it draws exactly what the default generator draws."""
    if sizing.window is not None:
        raise TaskError(
            f"ui-reply has no distance to size: window {sizing.window} applies to recall only (accepted for "
            "ui-reply: max_tokens, the tokenizer and the prompt format); drop the window"
        )
    budget = sizing.max_tokens or UI_MAX_TOKENS
    from kvgraft.data.tasks.sizing import SIZED_DRAWS

    for _ in range(SIZED_DRAWS):
        ex = _ui_attempt(r, sizing.count, budget, sizing.example_tokens)
        if ex is not None and sizing.exact_length(ex) <= budget:
            return ex
    raise TaskError(
        f"ui-reply: no screen of {UI_MIN_COMPONENTS} components fits max_tokens {budget} in the "
        f"{sizing.prompt_format} encoding of {sizing.tokenizer_name}; accepted: a larger max_tokens (500 fits 3-10)"
    )


def _ui_sized_generator(sizing: Any) -> Callable[[random.Random], Example]:
    def make(r: random.Random) -> Example:
        return sized_ui_example(r, sizing)

    return make


def _ui_sized_info(sizing: Any, splits: Any) -> dict[str, Any]:
    budget = sizing.max_tokens or UI_MAX_TOKENS
    return {
        "token_budget": {
            "max_tokens": budget,
            "counted": sizing.encoding.describe()["counted"],
            "tokenizer": sizing.tokenizer_name,
            "tokenizer_sha256": sizing.tokenizer_sha256,
        },
        "sizing": sizing.to_dict() | {"max_tokens": budget},
    }


# --------------------------------------------------------------------------- scoring and registration

_JSON_BLOCK_RE = re.compile(r"```json\s*\n(.*?)\n?```", re.DOTALL)


def extract_ui_reply(text: str) -> str | None:
    """The canonical JSON of the last complete ```json block of ``text`` (or, without one, of the text from
    the first ``{`` to the last ``}``), None if it does not parse."""
    blocks = _JSON_BLOCK_RE.findall(text)
    if blocks:
        candidate = blocks[-1]
    else:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end < start:
            return None
        candidate = text[start : end + 1]
    try:
        return canonical_json(json.loads(candidate))
    except (json.JSONDecodeError, RecursionError):
        return None


def _ui_generator() -> Callable[[random.Random], Example]:
    count = _reference_counter()

    def make(r: random.Random) -> Example:
        return _ui_example(r, count)

    return make


def _ui_info() -> dict[str, Any]:
    return {"token_budget": reference_token_budget(UI_MAX_TOKENS)}


SPEC = TaskSpec(
    name="ui-reply",
    summary="an assistant reply describing a requested screen: prose plus a JSON component tree "
    "(about 15x longer than geometry, at most 500 tokens)",
    generator=_ui_generator,
    format={
        "fields": ["prompt", "answer", "target", "kind"],
        "prompt": "User: <request>\\nAssistant:",
        "answer": " <prose and bullets>\\n```json\\n<component tree>\\n```\\n<closing sentence>",
        "target": "canonical JSON of the component tree (sorted keys, no spaces)",
        "correct": "the reply's JSON block parses and equals the target exactly",
    },
    extract=extract_ui_reply,
    info=_ui_info,
    sized_generator=_ui_sized_generator,
    sized_info=_ui_sized_info,
)
