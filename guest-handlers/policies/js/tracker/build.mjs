// Builds a JavaScript policy into a component with componentize-js's JS API, called
// directly (the `jco componentize` / `componentize-js` CLIs add nothing here but option
// parsing). Also the build script of the projects `allocbox new --lang js` writes.
//
//   node build.mjs SOURCE.js WIT_DIR OUT.wasm
import { componentize } from '@bytecodealliance/componentize-js';
// The same module instance componentize-js itself imports (the package's `exports`
// map hides it, so it is named by path).
import { splicer } from './node_modules/@bytecodealliance/componentize-js/lib/spidermonkey-embedding-splicer.js';
import { writeFile } from 'node:fs/promises';

const [sourcePath, witPath, out] = process.argv.slice(2);

// The JS glue that componentize-js generates for the world (jco's bindgen) calls
// `_debugLog('...', { funcName, paramCount, ... })` two or three times in every export
// and import. `_debugLog` does nothing unless `process.env.JCO_DEBUG` is set, which
// never exists inside the component, but its arguments are built first: two or three
// object literals per call for the collector, in an interpreter. Prefixing each call
// with `0 && ` skips them unevaluated (measured: 13.4 -> 9.6 us per allocator call on
// a replayed trace). The definition (`const _debugLog = ...`) has no `(` after the
// name and is left alone; every call site is a statement, whose value nobody reads.
const spliceBindings = splicer.spliceBindings;
splicer.spliceBindings = (...args) => {
  const spliced = spliceBindings(...args);
  spliced.jsBindings = spliced.jsBindings.replace(/(?<![\w$.])_debugLog\(/g, '0 && _debugLog(');
  return spliced;
};

const { component } = await componentize({
  sourcePath,
  witPath,
  worldName: 'policy',
  // A "pure" component: no WASI imports at all, only the world's. The host grants a
  // guest nothing anyway, and without `random` the engine's own randomness (hash
  // seeds, Math.random) is a fixed sequence. The price: an uncaught exception traps
  // without a message (there is no stderr to print it to).
  disableFeatures: ['stdio', 'random', 'clocks', 'http', 'fetch-event'],
});
await writeFile(out, component);
