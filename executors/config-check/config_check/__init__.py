"""config-check: compare a configuration file's values with expected ones.

params: {"path": "/abs/file", "expected": {"key": value, ...},
         "format": "auto"|"ini"|"json"|"keyvalue"|"keyword"}

Key names: json — a top-level key, or a dotted path through nested objects ("server.port",
"users.0.name"); ini — "section.key" ("DEFAULT.key" for the defaults); keyvalue — the key as
written before "=" or ":"; keyword — the first word of a "Keyword value" line as in
sshd_config(5) or login.defs(5), case-insensitive.

Output: {"path", "format", "checked", "differences": [{"key", "expected", "actual"}],
"missing": [keys], "compliant": bool}; compliant is true when nothing differs and nothing is
missing (status "completed"), false otherwise (status "partial").
"""

from s4e_agent.executor import BaseExecutor, ExecutorResult

FORMATS = ("auto", "ini", "json", "keyvalue", "keyword")

#: Files larger than this are not read (a configuration file, not a data set).
MAX_FILE_BYTES = 16 * 1024 * 1024


class ConfigCheckExecutor(BaseExecutor):
    """Checks that a configuration file holds the expected values."""

    name = "config-check"
    version = "1.0.0"

    def validate(self, params: dict) -> bool:
        import os

        path = params.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError("Missing required parameter: path (an absolute file path)")
        if not os.path.isabs(path):
            raise ValueError(f"path must be absolute, not {path!r}")
        if "\0" in path:
            raise ValueError("path must not contain NUL")
        expected = params.get("expected")
        if not isinstance(expected, dict):
            raise ValueError("Missing required parameter: expected (an object of key: value)")
        fmt = params.get("format", "auto")
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
        return True

    def execute(self, params: dict, context: dict) -> ExecutorResult:
        path = params["path"]
        expected = params["expected"]
        requested = params.get("format", "auto")
        log = context["logger"]
        base = {"path": path}

        try:
            text = _read(path)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            log.error("cannot read the configuration file", path=path, error=reason)
            return ExecutorResult(
                status="failed",
                output=base,
                error=(
                    f"cannot read {path}: {reason} (errno {exc.errno}). Inside the sandbox only the "
                    "executor's own directory, the paths declared in the manifest's "
                    "permissions.filesystem.read and the interpreter's own files are visible"
                ),
            )
        except ValueError as exc:  # too large, not UTF-8
            log.error("cannot read the configuration file", path=path, error=str(exc))
            return ExecutorResult(status="failed", output=base, error=f"cannot read {path}: {exc}")

        fmt = _detect(path, text) if requested == "auto" else requested
        base["format"] = fmt
        try:
            lookup = _PARSERS[fmt](text)
        except ValueError as exc:
            log.error("cannot parse the configuration file", path=path, format=fmt, error=str(exc))
            return ExecutorResult(status="failed", output=base, error=f"cannot parse {path} as {fmt}: {exc}")

        log.info("checking configuration", path=path, format=fmt, keys=len(expected))
        differences = []
        missing = []
        for key, want in expected.items():
            found, actual = lookup(key)
            if not found:
                missing.append(key)
            elif not _same(want, actual):
                differences.append({"key": key, "expected": want, "actual": actual})
        compliant = not differences and not missing
        output = dict(base, checked=len(expected), differences=differences, missing=missing, compliant=compliant)
        status = "completed" if compliant else "partial"
        log.info("configuration checked", differences=len(differences), missing=len(missing), compliant=compliant)
        return ExecutorResult(status=status, output=output)

    def cleanup(self, context: dict):
        pass


def _read(path):
    """The file's text. OSError when it cannot be opened; ValueError when too large or not UTF-8."""
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


#: File names that are keyword files whatever their content looks like.
KEYWORD_FILES = ("sshd_config", "ssh_config", "login.defs")


def _detect(path, text):
    """auto: .json → json, .ini → ini, sshd_config / ssh_config / login.defs → keyword;
    otherwise a text starting with "{" is json, a text with a "[section]" line is ini, and
    else each non-comment line votes: "key = value" / "key: value" for keyvalue, "Keyword value"
    for keyword; keyword wins only with more votes (a tie is keyvalue)."""
    import os
    import re

    lower = path.lower()
    if lower.endswith(".json"):
        return "json"
    if lower.endswith(".ini"):
        return "ini"
    if os.path.basename(lower) in KEYWORD_FILES:
        return "keyword"
    if text.lstrip().startswith("{"):
        return "json"
    if re.search(r"^[ \t]*\[[^\[\]\n]+\][ \t]*$", text, re.MULTILINE):
        return "ini"
    votes = {"keyvalue": 0, "keyword": 0}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        # The first word, up to whitespace, "=" or ":"; what follows it decides.
        m = re.match(r"[^\s=:]+\s*([=:])?", line)
        if m is None:
            continue  # a line starting with "=" or ":"
        if m.group(1):
            votes["keyvalue"] += 1
        elif m.end() < len(line):
            votes["keyword"] += 1
    return "keyword" if votes["keyword"] > votes["keyvalue"] else "keyvalue"


def _parse_json(text):
    import json

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(data, dict):
        raise ValueError(f"the top level is a {type(data).__name__}, not an object")

    def lookup(key):
        if key in data:
            return True, data[key]
        node = data
        for part in key.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return False, None
        return True, node

    return lookup


def _parse_ini(text):
    import configparser

    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error as exc:
        raise ValueError(str(exc).replace("\n", " ")) from None
    # Longest section names first, so "a.b.key" prefers section "a.b" over section "a".
    sections = sorted(parser.sections() + [parser.default_section], key=len, reverse=True)

    def lookup(key):
        for section in sections:
            if key.startswith(section + "."):
                option = key[len(section) + 1:]
                if section == parser.default_section:
                    values = parser.defaults()
                else:
                    values = parser[section]
                option = parser.optionxform(option)
                if option in values:
                    return True, values[option]
        return False, None

    return lookup


def _parse_keyvalue(text):
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cut = [i for i in (line.find("="), line.find(":")) if i > 0]
        if not cut:
            continue  # not a key/value line
        i = min(cut)
        key, value = line[:i].strip(), line[i + 1:].strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key] = value  # the last occurrence wins

    def lookup(key):
        if key in values:
            return True, values[key]
        return False, None

    return lookup


def _parse_keyword(text):
    """sshd_config(5) / login.defs(5) style: "Keyword value" lines.

    The keyword is the first word; the value is the rest of the line, after whitespace and at
    most one "=" (sshd_config allows "Port=22" and "Port = 22"), with whitespace runs collapsed
    to one space and one pair of surrounding quotes removed. Keywords are case-insensitive.
    The first occurrence wins (sshd_config's rule). A "Match" line ends the global part: the
    lines after it apply only to some connections and are not read. "Include" is not followed.
    Lines starting with "#" are comments; a keyword without a value is ignored.
    """
    import re

    values = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([^\s=]+)(?:\s*=\s*|\s+)(.*)$", line)
        if m is None:
            continue  # a keyword alone, or a line starting with "="
        key, value = m.group(1).lower(), " ".join(m.group(2).split())
        if key == "match":
            break
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        if value:
            values.setdefault(key, value)  # the first occurrence wins

    def lookup(key):
        folded = key.lower()
        if folded in values:
            return True, values[folded]
        return False, None

    return lookup


_PARSERS = {"json": _parse_json, "ini": _parse_ini, "keyvalue": _parse_keyvalue, "keyword": _parse_keyword}


def _text(value):
    """A JSON value as configuration text: true → "true", 8080 → "8080", "x" → "x"."""
    import json

    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(expected, actual):
    """Numbers compare numerically (8080 == 8080.0); anything else compares as text, so an
    expected 8080 or true matches the text "8080" or "true" of an ini or keyvalue file."""
    if _is_number(expected) and _is_number(actual):
        return expected == actual
    return _text(expected) == _text(actual)
