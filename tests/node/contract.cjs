// The wire-contract checks of tests/test_wire_contract.py, run by Node with the packages
// the test installed (NODE_PATH points at them).
//
//   node contract.cjs compile SCHEMA.json          -> {"ok": true} or {"ok": false, "error"}
//   node contract.cjs validate SCHEMA.json CASES.json
//        CASES: [{"id", "def" | "schema", "instance"}]; "def" names SCHEMA's $defs entry
//        -> [{"id", "valid", "errors"}]
//   node contract.cjs asyncapi DOC(.yaml|.json)   -> {"diagnostics": [...], "channels", "operations"}
//
// Ajv runs in strict mode with the JSON Schema 2020-12 dialect (ajv/dist/2020).
"use strict";
const fs = require("fs");

function strictAjv() {
  const Ajv2020 = require("ajv/dist/2020").default;
  return new Ajv2020({ strict: true, allErrors: true });
}

function compile(schemaPath) {
  const schema = JSON.parse(fs.readFileSync(schemaPath, "utf8"));
  try {
    strictAjv().compile(schema);
    return { ok: true };
  } catch (err) {
    return { ok: false, error: String(err && err.message) };
  }
}

function validate(schemaPath, casesPath) {
  const schema = JSON.parse(fs.readFileSync(schemaPath, "utf8"));
  const cases = JSON.parse(fs.readFileSync(casesPath, "utf8"));
  const ajv = strictAjv();
  ajv.addSchema(schema, "wire");
  const compiled = new Map();
  const validator = (c) => {
    if (c.schema !== undefined) return ajv.compile(c.schema);
    if (!compiled.has(c.def)) {
      const v = ajv.getSchema(`wire#/$defs/${c.def}`);
      if (!v) throw new Error(`no definition ${c.def}`);
      compiled.set(c.def, v);
    }
    return compiled.get(c.def);
  };
  return cases.map((c) => {
    const v = validator(c);
    const valid = v(c.instance);
    return { id: c.id, valid, errors: valid ? [] : v.errors };
  });
}

async function asyncapi(docPath) {
  const { Parser } = require("@asyncapi/parser");
  const parser = new Parser();
  const { document, diagnostics } = await parser.parse(fs.readFileSync(docPath, "utf8"));
  return {
    diagnostics: diagnostics.map((d) => ({
      severity: d.severity, code: d.code, message: d.message, path: d.path,
    })),
    channels: document ? document.channels().length : 0,
    operations: document ? document.operations().length : 0,
    messages: document ? document.allMessages().length : 0,
  };
}

async function main() {
  const [cmd, ...args] = process.argv.slice(2);
  let out;
  if (cmd === "compile") out = compile(args[0]);
  else if (cmd === "validate") out = validate(args[0], args[1]);
  else if (cmd === "asyncapi") out = await asyncapi(args[0]);
  else throw new Error(`unknown command ${cmd}`);
  process.stdout.write(JSON.stringify(out));
}

main().catch((err) => {
  process.stderr.write(String((err && err.stack) || err) + "\n");
  process.exit(2);
});
