// Renames the exports of the compiled module to the canonical-ABI names of the
// `allocbox:policy` world. AssemblyScript can only export identifiers, so the policy
// (`slab.ts`; `allocbox new --lang assemblyscript` copies this script into its projects)
// exports `malloc`, `malloc_many`, `init` ... and this script maps them to
// `allocbox:policy/allocator@0.1.0#malloc` ... (imports already carry their names,
// through `@external`). Usage: node rename.mjs IN.wasm OUT.wasm
import { readFileSync, writeFileSync } from "node:fs";
import binaryen from "binaryen";

const ALLOCATOR = "allocbox:policy/allocator@0.1.0#";
const LIFECYCLE = "allocbox:policy/lifecycle@0.1.0#";
const NAMES = {
  malloc: ALLOCATOR + "malloc",
  calloc: ALLOCATOR + "calloc",
  realloc: ALLOCATOR + "realloc",
  free: ALLOCATOR + "free",
  malloc_many: ALLOCATOR + "malloc-many",
  free_many: ALLOCATOR + "free-many",
  init: LIFECYCLE + "init",
  trim: LIFECYCLE + "trim",
  cabi_realloc: "cabi_realloc",
};

const [input, output] = process.argv.slice(2);
const module = binaryen.readBinary(readFileSync(input));
// AssemblyScript emits bulk-memory operations (memory.copy, memory.fill) and more.
module.setFeatures(binaryen.Features.All);
const exports = [];
for (let i = 0; i < module.getNumExports(); i++) {
  exports.push(binaryen.getExportInfo(module.getExportByIndex(i)));
}
const missing = new Set(Object.keys(NAMES));
for (const { kind, name, value } of exports) {
  if (kind === binaryen.ExternalMemory && name === "memory") continue;
  // Anything else would be an export the world does not know: the host refuses it.
  if (kind !== binaryen.ExternalFunction || !(name in NAMES)) {
    throw new Error(`unexpected export \`${name}\``);
  }
  missing.delete(name);
  module.removeExport(name);
  module.addFunctionExport(value, NAMES[name]);
}
if (missing.size) throw new Error(`missing exports: ${[...missing].join(", ")}`);
if (!module.validate()) throw new Error("renamed module does not validate");
writeFileSync(output, module.emitBinary());
