"""Record a policy's source language in its wasm `producers` section, so `allocbox
inspect` can say what it was written in.

    python3 guest-handlers/scripts/stamp_language.py POLICY.wasm LANGUAGE

Works on a core module or a component: the top-level `producers` custom section gets
`language = [LANGUAGE]` (its other fields, such as `processed-by`, are kept). Toolchains
that record no language (freestanding clang, Zig, AssemblyScript, componentize-py) have
their build.sh call this.
"""

import sys


def leb(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def read_leb(data, at):
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def read_name(data, at):
    length, at = read_leb(data, at)
    return data[at : at + length].decode(), at + length


def name(text):
    raw = text.encode()
    return leb(len(raw)) + raw


def sections(module):
    """(id, body) of each top-level section after the 8-byte header."""
    at = 8
    while at < len(module):
        section_id = module[at]
        size, at = read_leb(module, at + 1)
        yield section_id, module[at : at + size]
        at += size


def parse_producers(body):
    """{field: [(name, version)]} from a producers section's body (after its name)."""
    fields = {}
    count, at = read_leb(body, 0)
    for _ in range(count):
        field, at = read_name(body, at)
        values, at = read_leb(body, at)
        fields[field] = []
        for _ in range(values):
            value, at = read_name(body, at)
            version, at = read_name(body, at)
            fields[field].append((value, version))
    return fields


def producers_section(fields):
    body = leb(len(fields))
    for field, values in fields.items():
        body += name(field) + leb(len(values))
        for value, version in values:
            body += name(value) + name(version)
    payload = name("producers") + body
    return bytes([0]) + leb(len(payload)) + payload


def stamp(module, language):
    if module[:4] != b"\0asm":
        raise SystemExit("not a wasm binary")
    kept = bytearray(module[:8])
    fields = {}
    for section_id, body in sections(module):
        if section_id == 0:
            section_name, after = read_name(body, 0)
            if section_name == "producers":
                fields = parse_producers(body[after:])
                continue
        kept += bytes([section_id]) + leb(len(body)) + body
    fields["language"] = [(language, "")]
    return bytes(kept) + producers_section(fields)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    path, language = sys.argv[1:]
    with open(path, "rb") as f:
        stamped = stamp(f.read(), language)
    with open(path, "wb") as f:
        f.write(stamped)
