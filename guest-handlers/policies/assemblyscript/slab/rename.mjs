// Renames the exports of the compiled module to the canonical-ABI names of the
// `allocbox:policy` world. AssemblyScript can only export identifiers, so the policy
// (`slab.ts`; `allocbox new --lang assemblyscript` copies this script into its projects)
// exports `malloc`, `malloc_many`, `init` ... and this script maps them to
// `allocbox:policy/allocator@0.2.0#malloc` ... (imports already carry their names,
// through `@external`). Usage: node rename.mjs IN.wasm OUT.wasm
//
// The contract version is the one the module's imports name (`@external(
// "allocbox:policy/allocator@0.2.0", ...)`), or 0.2.0 when it exports a function only
// 0.2.0 has; otherwise 0.1.0, which the `allocbox new` template still speaks. Every
// function of that version's world must be exported (the host refuses a world with one
// missing); `shardable` is optional, and exporting it makes the module a
// `sharding-policy`.
import { readFileSync, writeFileSync } from "node:fs";
import binaryen from "binaryen";

const names = (version) => {
  const allocator = `allocbox:policy/allocator@${version}#`;
  const lifecycle = `allocbox:policy/lifecycle@${version}#`;
  return {
    malloc: allocator + "malloc",
    calloc: allocator + "calloc",
    realloc: allocator + "realloc",
    free: allocator + "free",
    malloc_many: allocator + "malloc-many",
    free_many: allocator + "free-many",
    init: lifecycle + "init",
    trim: lifecycle + "trim",
    cabi_realloc: "cabi_realloc",
  };
};
const V1 = names("0.1.0");
const OBSERVER = "allocbox:policy/observer@0.2.0#";
const V2 = {
  ...names("0.2.0"),
  report: "allocbox:policy/lifecycle@0.2.0#report",
  observes: OBSERVER + "observes",
  observe: OBSERVER + "observe",
  renew: OBSERVER + "renew",
};
const V2_OPTIONAL = { shardable: "allocbox:policy/sharding@0.2.0#shardable" };

const [input, output] = process.argv.slice(2);
const module = binaryen.readBinary(readFileSync(input));
// AssemblyScript emits bulk-memory operations (memory.copy, memory.fill) and more.
module.setFeatures(binaryen.Features.All);
const exports = [];
for (let i = 0; i < module.getNumExports(); i++) {
  exports.push(binaryen.getExportInfo(module.getExportByIndex(i)));
}
const imports0_2_0 = () => {
  for (let i = 0; i < module.getNumFunctions(); i++) {
    const f = binaryen.getFunctionInfo(module.getFunctionByIndex(i));
    if (f.module && f.module.startsWith("allocbox:policy/") && f.module.endsWith("@0.2.0")) {
      return true;
    }
  }
  return false;
};
const only0_2_0 = Object.keys(V2).filter((n) => !(n in V1)).concat(Object.keys(V2_OPTIONAL));
const v2 = imports0_2_0() || exports.some(({ name }) => only0_2_0.includes(name));
const NAMES = v2 ? { ...V2, ...V2_OPTIONAL } : V1;
const missing = new Set(Object.keys(v2 ? V2 : V1));
for (const { kind, name, value } of exports) {
  if (kind === binaryen.ExternalMemory && name === "memory") continue;
  // Anything else would be an export the world does not know: the host refuses it.
  if (kind !== binaryen.ExternalFunction || !(name in NAMES)) {
    throw new Error(`unexpected export \`${name}\` (contract ${v2 ? "0.2.0" : "0.1.0"})`);
  }
  missing.delete(name);
  module.removeExport(name);
  module.addFunctionExport(value, NAMES[name]);
}
if (missing.size) {
  throw new Error(`missing exports (contract ${v2 ? "0.2.0" : "0.1.0"}): ${[...missing].join(", ")}`);
}
if (!module.validate()) throw new Error("renamed module does not validate");
writeFileSync(output, module.emitBinary());
