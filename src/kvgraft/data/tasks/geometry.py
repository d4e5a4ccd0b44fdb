r"""The ``geometry`` task: text-only geometry word problems with one or two worked arithmetic steps.

A small analogue of Geometry3K (the short-answer maths task of the LoRA study the tasks stand in for);
with the reference tokenizer an example is about 31 tokens. The final answer is the number after the
last ``=`` of the answer line::

    prompt  "Q: A triangle has angles 50 and 60. Third angle?\nA:"
    answer  " 180-50-60=70"                                   target "70"
    prompt  "Q: A right triangle has legs 6 and 8. Hypotenuse?\nA:"
    answer  " 6^2+8^2=100, c=10"                              target "10"

``target`` is that number as text (integers plainly, otherwise at most two decimals, e.g.
``"153.86"``); the answer is computed exactly. The templates, one per ``Example.kind``, are
``GEOMETRY_KINDS`` (its docstring gives each one's numbers and formula).

Each draw picks a kind uniformly; a problem whose prompt was drawn before is dropped, so the
small kinds (regular polygons, Pythagorean triples) saturate and the large ones fill the rest.

Scoring: the checkable answer of generated text is the number after the last ``=`` of its first line;
it is correct when within 1e-2 relative of the target.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping

from kvgraft.data.tasks.common import Example, TaskSpec, _first_line


def _fmt(x: float) -> str:
    """A number as the tasks write it: integers plainly, otherwise at most two decimals."""
    r = round(x, 2)
    if r == int(r):
        return str(int(r))
    return f"{r:.2f}".rstrip("0").rstrip(".")


# --------------------------------------------------------------------------- templates

_Geo = tuple[str, str, float]  # problem text, worked steps, value
_TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29))
_DIVISORS_360 = tuple(n for n in range(3, 37) if 360 % n == 0)
_SCALES = (0.5, 1.5, 2, 2.5, 3, 4)


def _triple(r: random.Random) -> tuple[int, int, int]:
    a, b, c = r.choice(_TRIPLES)
    k = r.randint(1, 10 if c <= 5 else 3 if c <= 17 else 1)
    a, b = (a, b) if r.random() < 0.5 else (b, a)
    return a * k, b * k, c * k


def _g_triangle_third(r: random.Random) -> _Geo:
    a = r.randint(20, 100)
    b = r.randint(20, 150 - a)
    c = 180 - a - b
    return f"A triangle has angles {a} and {b}. Third angle?", f"180-{a}-{b}={c}", c


def _g_straight_line(r: random.Random) -> _Geo:
    a = r.randint(10, 170)
    return f"Two angles on a line: {a} and x. Find x.", f"180-{a}={180 - a}", 180 - a


def _g_complementary(r: random.Random) -> _Geo:
    a = r.randint(5, 85)
    return f"Complementary angles: {a} and x. Find x.", f"90-{a}={90 - a}", 90 - a


def _g_isosceles_base(r: random.Random) -> _Geo:
    a = 2 * r.randint(10, 80)
    v = (180 - a) // 2
    return f"An isosceles triangle has apex angle {a}. Base angle?", f"(180-{a})/2={v}", v


def _g_isosceles_apex(r: random.Random) -> _Geo:
    b = r.randint(20, 85)
    v = 180 - 2 * b
    return f"An isosceles triangle has base angles {b}. Apex angle?", f"180-2*{b}={v}", v


def _g_polygon_sum(r: random.Random) -> _Geo:
    n = r.randint(3, 30)
    v = (n - 2) * 180
    return f"Angle sum of a {n}-sided polygon?", f"({n}-2)*180={v}", v


def _g_regular_interior(r: random.Random) -> _Geo:
    n = r.choice(_DIVISORS_360)
    v = (n - 2) * 180 // n
    return f"Each angle of a regular {n}-sided polygon?", f"({n}-2)*180/{n}={v}", v


def _g_regular_exterior(r: random.Random) -> _Geo:
    n = r.choice(_DIVISORS_360)
    return f"Each exterior angle of a regular {n}-sided polygon?", f"360/{n}={360 // n}", 360 // n


def _g_hypotenuse(r: random.Random) -> _Geo:
    a, b, c = _triple(r)
    return f"A right triangle has legs {a} and {b}. Hypotenuse?", f"{a}^2+{b}^2={c * c}, c={c}", c


def _g_leg(r: random.Random) -> _Geo:
    a, b, c = _triple(r)
    return (f"A right triangle has hypotenuse {c} and leg {a}. Other leg?", f"{c}^2-{a}^2={b * b}, b={b}", b)


def _g_rectangle_area(r: random.Random) -> _Geo:
    w, h = r.randint(2, 30), r.randint(2, 30)
    return f"A rectangle is {w} by {h}. Area?", f"{w}*{h}={w * h}", w * h


def _g_rectangle_perimeter(r: random.Random) -> _Geo:
    w, h = r.randint(2, 40), r.randint(2, 40)
    return f"A rectangle is {w} by {h}. Perimeter?", f"2*({w}+{h})={2 * (w + h)}", 2 * (w + h)


def _g_triangle_area(r: random.Random) -> _Geo:
    b, h = r.randint(2, 30), r.randint(2, 30)
    v = b * h / 2
    return f"A triangle has base {b} and height {h}. Area?", f"{b}*{h}/2={_fmt(v)}", v


def _g_circle_area(r: random.Random) -> _Geo:
    rad = r.randint(1, 20)
    v = 314 * rad * rad / 100  # exact to two decimals
    return f"A circle has radius {rad}. Area (pi=3.14)?", f"3.14*{rad}^2={_fmt(v)}", v


def _g_circumference(r: random.Random) -> _Geo:
    rad = r.randint(1, 30)
    v = 628 * rad / 100
    return f"A circle has radius {rad}. Circumference (pi=3.14)?", f"2*3.14*{rad}={_fmt(v)}", v


def _g_square_area(r: random.Random) -> _Geo:
    s = r.randint(2, 30)
    p = 4 * s
    return f"A square has perimeter {p}. Area?", f"{p}/4={s}, {s}*{s}={s * s}", s * s


def _g_triangle_perimeter(r: random.Random) -> _Geo:
    while True:
        a, b, c = (r.randint(2, 30) for _ in range(3))
        if a + b > c and a + c > b and b + c > a:
            break
    return f"A triangle has sides {a}, {b} and {c}. Perimeter?", f"{a}+{b}+{c}={a + b + c}", a + b + c


def _g_similar_side(r: random.Random) -> _Geo:
    while True:
        a, k, bc = r.randint(2, 12), r.choice(_SCALES), r.randint(2, 15)
        if a * k == int(a * k):
            break
    d = int(a * k)
    v = bc * k
    return f"Similar triangles ABC, DEF: AB={a}, DE={d}, BC={bc}. EF?", f"{bc}*{d}/{a}={_fmt(v)}", v


def _g_scale_factor(r: random.Random) -> _Geo:
    while True:
        a, k = r.randint(2, 20), r.choice(_SCALES)
        if a * k == int(a * k):
            break
    b = int(a * k)
    return f"Similar triangles have matching sides {a} and {b}. Scale factor?", f"{b}/{a}={_fmt(k)}", k


GEOMETRY_KINDS: Mapping[str, Callable[[random.Random], _Geo]] = {
    "triangle-third": _g_triangle_third,
    "straight-line": _g_straight_line,
    "complementary": _g_complementary,
    "isosceles-base": _g_isosceles_base,
    "isosceles-apex": _g_isosceles_apex,
    "polygon-sum": _g_polygon_sum,
    "regular-interior": _g_regular_interior,
    "regular-exterior": _g_regular_exterior,
    "hypotenuse": _g_hypotenuse,
    "leg": _g_leg,
    "rectangle-area": _g_rectangle_area,
    "rectangle-perimeter": _g_rectangle_perimeter,
    "triangle-area": _g_triangle_area,
    "circle-area": _g_circle_area,
    "circumference": _g_circumference,
    "square-area": _g_square_area,
    "triangle-perimeter": _g_triangle_perimeter,
    "similar-side": _g_similar_side,
    "scale-factor": _g_scale_factor,
}
"""Geometry templates by kind. The numbers appear in the prompt in the order named here, and the answer is
computed exactly (no floating point surprises: every answer is a whole number or has at most two decimals):

===================  ==========================================  ===========================
kind                 numbers in the prompt (ranges)              answer
===================  ==========================================  ===========================
triangle-third       angles a in 20..100, b in 20..150-a         180 - a - b
straight-line        angle a in 10..170                          180 - a
complementary        angle a in 5..85                            90 - a
isosceles-base       apex angle a, even, in 20..160              (180 - a) / 2
isosceles-apex       base angle b in 20..85                      180 - 2 b
polygon-sum          n sides in 3..30                            (n - 2) 180
regular-interior     n sides, a divisor of 360 in 3..36          (n - 2) 180 / n
regular-exterior     n sides, a divisor of 360 in 3..36          360 / n
hypotenuse           legs a, b: k(3,4) k<=10, k(5,12), k(8,15)   sqrt(a^2 + b^2) (a whole
                     k<=3, (7,24), (20,21); either order         number)
leg                  hypotenuse c, leg a of the same triples     sqrt(c^2 - a^2)
rectangle-area       w, h in 2..30                               w h
rectangle-perimeter  w, h in 2..40                               2 (w + h)
triangle-area        base b, height h in 2..30                   b h / 2
circle-area          radius r in 1..20 (pi = 3.14 is given)      3.14 r^2
circumference        radius r in 1..30 (pi = 3.14 is given)      2 (3.14) r
square-area          perimeter p = 4 s, s in 2..30               (p / 4)^2
triangle-perimeter   sides a, b, c in 2..30, a strict triangle   a + b + c
similar-side         AB = a in 2..12, DE = k a (whole),          BC DE / AB
                     BC in 2..15, k in {0.5, 1.5, 2, 2.5, 3, 4}
scale-factor         matching sides a in 2..20 and k a (whole)   (k a) / a
===================  ==========================================  ===========================
"""


def _geometry_example(r: random.Random) -> Example:
    kind = r.choice(tuple(GEOMETRY_KINDS))
    text, steps, value = GEOMETRY_KINDS[kind](r)
    target = _fmt(value)
    return Example(prompt=f"Q: {text}\nA:", answer=f" {steps}", target=target, kind=kind)


# --------------------------------------------------------------------------- scoring and registration

_FINAL_NUMBER_RE = re.compile(r"=\s*(-?\d+(?:\.\d+)?)")


def extract_geometry(text: str) -> str | None:
    """The number after the last ``=`` of the first line of ``text``, or None."""
    numbers = _FINAL_NUMBER_RE.findall(_first_line(text))
    return numbers[-1] if numbers else None


def geometry_correct(got: str, target: str) -> bool:
    """Whether the extracted number is within 1e-2 relative of the target."""
    return math.isclose(float(got), float(target), rel_tol=1e-2, abs_tol=1e-9)


def _geometry_generator() -> Callable[[random.Random], Example]:
    return _geometry_example


SPEC = TaskSpec(
    name="geometry",
    summary="geometry word problems (angles, Pythagoras, areas, perimeters, similar triangles): "
    "short worked steps and a numeric answer",
    generator=_geometry_generator,
    format={
        "fields": ["prompt", "answer", "target", "kind"],
        "prompt": "Q: <problem>\\nA:",
        "answer": " <worked steps>=<final number>",
        "target": "the final number",
        "correct": "final number within 1e-2 relative of the target",
    },
    extract=extract_geometry,
    correct=geometry_correct,
)
