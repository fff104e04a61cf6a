#!/usr/bin/env python3
"""Generates the plain-forwarding op files of `ContextParallel<B>` from burn-backend 0.21.0's traits.

Every method of every op trait (required and defaulted, so the inner backend's fast paths survive)
becomes `fn m(args) -> R { B::m(args) }`, written as a row of the `forward!` table (`ops/mod.rs`):
one row per signature, naming the methods that share it (`=> convert` where the result converts). Types generic over the backend (not plain associated
types) get converted by helpers in `burn-dcp/src/backend/convert.rs`. `ModuleOps::attention` is
routed to the hand-written interception in `burn-dcp/src/backend/attention.rs`, and
`FloatTensorOps::float_matmul` through `crate::backend::context::matmul`, which watches for
attention scores computed on a shard before it forwards.

Usage: python3 scripts/gen_forwarding.py [--check] [PATH_TO_burn-backend-0.21.0/src]
Rerun after changing it; the output is committed (burn-dcp/src/backend/ops/*.rs), formatted by
rustfmt. `--check` writes nothing: it generates into a temporary folder and fails (exit 1), naming
the files, when the committed ones differ (CI runs it).
"""
import filecmp
import glob
import os
import re
import subprocess
import sys
import tempfile

ARGS = [a for a in sys.argv[1:] if a != "--check"]
CHECK = "--check" in sys.argv[1:]
if ARGS:
    SRC = ARGS[0]
else:
    found = glob.glob(os.path.join(os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo")),
                                   "registry/src/*/burn-backend-0.21.0/src"))
    if not found:
        sys.exit("burn-backend 0.21.0's sources are not in cargo's registry: run `cargo fetch` "
                 "first, or pass PATH_TO_burn-backend-0.21.0/src")
    SRC = found[0]
OUT = os.path.join(os.path.dirname(__file__), "..", "burn-dcp", "src", "backend", "ops")

# (source file, trait, output file)
TRAITS = [
    ("backend/ops/tensor.rs", "FloatTensorOps", "tensor.rs"),
    ("backend/ops/int_tensor.rs", "IntTensorOps", "int_tensor.rs"),
    ("backend/ops/bool_tensor.rs", "BoolTensorOps", "bool_tensor.rs"),
    ("backend/ops/qtensor.rs", "QTensorOps", "qtensor.rs"),
    ("backend/ops/activation.rs", "ActivationOps", "activation.rs"),
    ("backend/ops/transaction.rs", "TransactionOps", "transaction.rs"),
    ("backend/ops/modules/base.rs", "ModuleOps", "module.rs"),
]

# Types generic over the backend: (type after B -> Self, convert into B's, convert from B's).
CONVERSIONS = {
    "TensorPrimitive<Self>": ("convert::primitive_in", "convert::primitive_out"),
    "QuantizationParametersPrimitive<Self>": ("convert::qparams_in", None),
    "TransactionPrimitive<Self>": ("convert::transaction_in", None),
    "MaxPool1dWithIndices<Self>": (None, "convert::max_pool1d_with_indices_out"),
    "MaxPool1dBackward<Self>": (None, "convert::max_pool1d_backward_out"),
    "MaxPool2dWithIndices<Self>": (None, "convert::max_pool2d_with_indices_out"),
    "MaxPool2dBackward<Self>": (None, "convert::max_pool2d_backward_out"),
    "DeformConv2dBackward<Self>": (None, "convert::deform_conv2d_backward_out"),
}

INTERCEPTED = {
    ("ModuleOps", "attention"): "crate::backend::attention::attention::<B>",
    # Watched for attention scores computed on a shard (a partly bypassed model).
    ("FloatTensorOps", "float_matmul"): "crate::backend::context::matmul::<B>",
}


def find_trait_body(text, trait):
    start = re.search(r"pub trait " + trait + r"\b[^{]*\{", text)
    if not start:
        raise SystemExit(f"trait {trait} not found")
    i, depth = start.end(), 1
    body_start = i
    while depth:
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        i += 1
    return text[body_start:i - 1]


def strip_comments(text):
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def methods(body):
    """Yields signatures `fn ...` (up to, not including, the body or ';') at depth 0 of the trait."""
    i, depth = 0, 0
    while i < len(body):
        c = body[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif depth == 0 and body.startswith("fn ", i) and (i == 0 or not body[i - 1].isalnum()):
            j, paren = i, 0
            while True:
                d = body[j]
                if d in "([":
                    paren += 1
                elif d in ")]":
                    paren -= 1
                elif paren == 0 and d in "{;":
                    break
                j += 1
            yield body[i:j].strip()
            i = j
            continue
        i += 1


def split_top(text, sep=","):
    parts, depth, cur = [], 0, ""
    text = text.replace("->", "\u2192")
    for c in text:
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if c == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        parts.append(cur)
    return [p.replace("\u2192", "->").strip() for p in parts]


def closing(text, open_, close):
    """The index of the `close` that matches the `open_` at the start of `text`."""
    depth = 0
    for k, c in enumerate(text):
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return k
    raise SystemExit(f"unbalanced {open_}{close}: {text}")


def parse(signature):
    m = re.match(r"fn\s+(\w+)\s*", signature)
    name = m.group(1)
    rest = signature[m.end():]
    generics = ""
    if rest.startswith("<"):
        k = closing(rest.replace("->", "\u2192"), "<", ">")
        generics = rest[:k + 1]
        rest = rest[k + 1:].lstrip()
    assert rest.startswith("("), signature
    k = closing(rest, "(", ")")
    params = split_top(rest[1:k])
    tail = rest[k + 1:].strip()
    ret, where = "", ""
    if tail.startswith("->"):
        tail = tail[2:].strip()
        w = re.search(r"\bwhere\b", tail)
        ret, where = (tail[:w.start()].strip(), tail[w.start():].strip()) if w else (tail.strip(), "")
    elif tail.startswith("where"):
        where = tail
    return name, generics, params, ret, where


def to_self(text):
    return re.sub(r"\bB\b", "Self", text).replace("crate::", "burn_backend::")


def render(trait, signature):
    """A method as `(key, text)`: plain forwards (their result converted or not) get the key of
    their signature (to share a `forward!` row with the methods of the same signature) and the
    method's name; converted arguments and interceptions get no key and their whole `fn`."""
    name, generics, params, ret, where = parse(signature)
    args, decls, converted = [], [], False
    for p in params:
        pname, ptype = [x.strip() for x in p.split(":", 1)]
        pname = pname.replace("mut ", "").strip()
        ptype = to_self(ptype)
        decls.append(f"{pname}: {ptype}")
        conv = CONVERSIONS.get(ptype, (None, None))[0]
        converted |= conv is not None
        args.append(f"{conv}({pname})" if conv else pname)
    ret = to_self(ret) or "()"
    call = f"B::{name}({', '.join(args)})"
    if (trait, name) in INTERCEPTED:
        call = f"{INTERCEPTED[(trait, name)]}({', '.join(args)})"
        converted = True
    wrapper = ""
    for ty, (_, out) in CONVERSIONS.items():
        if out and ret == ty:
            call = f"{out}({call})"
            wrapper = f" => {out}"
    if ret.startswith("Option<") and ret[7:-1] in CONVERSIONS and CONVERSIONS[ret[7:-1]][1]:
        call = f"{call}.map({CONVERSIONS[ret[7:-1]][1]})"
        converted = True
    if not converted and not generics and not where:
        return f"({', '.join(decls)}) -> {ret}{wrapper}", name
    head = f"fn {name}{to_self(generics)}({', '.join(decls)}) -> {ret}"
    if where:
        head += f" {to_self(where)}"
    return None, f"    {head} {{\n        {call}\n    }}\n"


def table(rendered):
    """The plain forwards as `forward!` rows, one per signature in the trait's order: the
    signature on one line, the names wrapped at 100 columns."""
    rows = {}
    for key, name in rendered:
        if key is not None:
            rows.setdefault(key, []).append(name)
    if not rows:
        return ""
    lines = ["    forward! {"]
    for key, names in rows.items():
        line = f"        {key}: "
        for i, name in enumerate(names):
            word = name + (";" if i == len(names) - 1 else ",")
            if len(line) + len(word) > 100 and not line.endswith(": "):
                lines.append(line.rstrip())
                line = "            "
            line += word + " "
        lines.append(line.rstrip())
    lines.append("    }")
    return "\n".join(lines) + "\n"


HEADER = """//! Generated by `scripts/gen_forwarding.py` from burn-backend 0.21.0: every method of `{trait}`
//! (required and defaulted) forwards to the inner backend `B` (a `forward!` row per signature:
//! `(parameters) -> return type: methods;`).{extra}
//! Do not edit by hand; rerun the script.

use super::prelude::*;

impl<B: CpInner> {trait}<Self> for ContextParallel<B> {{
"""


def generate(out):
    """Writes the forwarding files into `out`, formatted; returns their names."""
    os.makedirs(out, exist_ok=True)
    total = 0
    names = []
    for source, trait, output in TRAITS:
        text = strip_comments(open(os.path.join(SRC, source)).read())
        body = find_trait_body(text, trait)
        rendered = [render(trait, s) for s in methods(body)]
        explicit = [text for key, text in rendered if key is None]
        extra = ""
        if trait == "ModuleOps":
            extra = "\n//! Except `attention`, which `crate::backend::attention` intercepts for context parallelism."
        if trait == "FloatTensorOps":
            extra = "\n//! `float_matmul` goes through `crate::backend::context::matmul`, which watches for a shard's attention scores."
        names.append(output)
        with open(os.path.join(out, output), "w") as f:
            f.write(HEADER.format(trait=trait, extra=extra))
            f.write(table(rendered))
            f.write("".join("\n" + text for text in explicit))
            f.write("}\n")
        total += len(rendered)
        if not CHECK:
            print(f"{output}: {len(rendered)} methods of {trait}")
    subprocess.run(["rustfmt", "--edition", "2021"] + [os.path.join(out, n) for n in names],
                   check=True)
    if not CHECK:
        print(f"{total} methods in all")
    return names


def main():
    if not CHECK:
        generate(OUT)
        return
    with tempfile.TemporaryDirectory() as fresh:
        names = generate(fresh)
        stale = [n for n in names
                 if not os.path.exists(os.path.join(OUT, n))
                 or not filecmp.cmp(os.path.join(fresh, n), os.path.join(OUT, n), shallow=False)]
    if stale:
        print("stale generated forwarding (rerun python3 scripts/gen_forwarding.py): "
              + ", ".join(f"burn-dcp/src/backend/ops/{n}" for n in stale), file=sys.stderr)
        sys.exit(1)
    print(f"generated forwarding is current ({len(names)} files)")


if __name__ == "__main__":
    main()
