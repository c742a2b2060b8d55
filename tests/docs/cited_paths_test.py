"""Every repository path that the sources, scripts and documents cite exists.

A comment that says "see kernels/cpu/matmul.h" or a README that points at
`launch/local.sh` misleads as soon as the file moves. This walks the text
files (code, CMake, scripts, Markdown), finds every token that starts with
one of the repository's top-level folders, and fails listing the ones that
name nothing. A citation names something when it is, from the root or from
a folder above the citing file (CMake and scripts cite relative paths):
- a file or folder;
- a file's name without its extension (`common/text/unicode`);
- a generated Cap'n Proto header (`common/duet.capnp.h`);
- a program its folder's CMakeLists.txt builds (`tools/duet`).
Tokens followed by a wildcard or placeholder (`*`, `{`, `<`, `$`) are
patterns, not paths. Folders the repository ignores (`/models/` in
.gitignore: downloads) are not its paths.

Standard library only: python3 tests/docs/cited_paths_test.py
"""
import fnmatch
import glob
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ALWAYS_SKIPPED = {".git", "third_party", "__pycache__"}
TEXT_SUFFIXES = (".h", ".cpp", ".cu", ".cuh", ".cmake", ".sh", ".py", ".md", ".capnp", ".txt",
                 ".json", ".yaml", ".yml")
TEXT_NAMES = {"run"}


# A document named alone (`ARCHITECTURE.md`), and in a folder's README a
# backticked file of that folder (`router.h/.cpp`, `cluster/remote_instance.h`).
DOCUMENT = re.compile(r"(?<![\w./-])([A-Z][A-Z_]+\.md)\b")
README_FILE = re.compile(r"`([\w/]+\.(?:h|cpp|cu|capnp|sh|py|cmake|md))(/\.cpp)?`")


def ignored_folders():
    """Patterns of the root folders .gitignore names (`/build*/`, `/models/`)."""
    patterns = set(ALWAYS_SKIPPED)
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("/") and line.endswith("/"):
                patterns.add(line.strip("/"))
    return patterns


def is_ignored(name, ignored):
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in ignored)


def top_level_folders(ignored):
    return sorted(name for name in os.listdir(ROOT)
                  if os.path.isdir(os.path.join(ROOT, name)) and not is_ignored(name, ignored))


def text_files(ignored):
    for folder, dirs, files in os.walk(ROOT):
        at_root = os.path.samefile(folder, ROOT)
        dirs[:] = [d for d in dirs
                   if d not in ALWAYS_SKIPPED and not (at_root and is_ignored(d, ignored))]
        for name in files:
            if name.endswith(TEXT_SUFFIXES) or name in TEXT_NAMES:
                yield os.path.join(folder, name)


def cited_paths(text, pattern):
    for match in pattern.finditer(text):
        path = match.group(1)
        after = text[match.end():match.end() + 2]
        if after[:1] in ("*", "{", "<", "$") or after in (".$", ".*", ".{", ".<"):
            continue
        yield path.rstrip(".")


def builds_program(path):
    cmake = os.path.join(os.path.dirname(path), "CMakeLists.txt")
    if not os.path.isfile(cmake):
        return False
    with open(cmake, encoding="utf-8") as f:
        return re.search(r"\(\s*%s\s" % re.escape(os.path.basename(path)), f.read()) is not None


def names_something(cited, citing_file):
    bases, folder = [ROOT, os.path.join(ROOT, "docs")], os.path.dirname(citing_file)
    while os.path.commonpath([folder, ROOT]) == ROOT and folder != ROOT:
        bases.append(folder)
        folder = os.path.dirname(folder)
    for base in bases:
        path = os.path.join(base, cited)
        if os.path.exists(path) or glob.glob(glob.escape(path) + ".*"):
            return True
        if path.endswith(".capnp.h") and os.path.exists(path[:-2]):
            return True
        if builds_program(path):
            return True
    return False


def main():
    ignored = ignored_folders()
    folders = top_level_folders(ignored)
    pattern = re.compile(r"(?<![\w./@:$-])((?:%s)/[\w./+-]*[\w+])" %
                         "|".join(re.escape(f) for f in folders))
    missing, n_cited = set(), 0
    for path in text_files(ignored):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        cited = list(cited_paths(text, pattern))
        cited += [m.group(1) for m in DOCUMENT.finditer(text)]
        if os.path.basename(path) == "README.md" and os.path.dirname(path) != ROOT:
            for m in README_FILE.finditer(text):
                cited.append(m.group(1))
                if m.group(2):
                    cited.append(m.group(1).rsplit(".", 1)[0] + ".cpp")
        for c in cited:
            n_cited += 1
            if not names_something(c, path):
                missing.add(f"{os.path.relpath(path, ROOT)}: {c}")
    print(f"{n_cited} citations under {', '.join(folders)} checked")
    if missing:
        print("paths cited but not in the repository:")
        for line in sorted(missing):
            print("  " + line)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
