// Drives the page at /ui in jsdom against a running cluster, as a user would: the page is
// fetched from the server and its own inline script runs; it is refused for want of the API
// key, is given the key in its key box, fills its tables and charts from /ui/data, and streams
// a chat from /api/chat. Prints one JSON line of what the page showed (tests/coordinator/
// test_ui_page.py asserts on it).
//
// node ui_page_driver.mjs URL API_KEY NODE_MODULES_DIR PROMPT
import { createRequire } from "node:module";
import path from "node:path";

const [url, apiKey, modules] = process.argv.slice(2);
const require = createRequire(path.join(modules, "noop.js"));
const { JSDOM, VirtualConsole } = require("jsdom");

const pageErrors = [];
const virtualConsole = new VirtualConsole();
virtualConsole.on("jsdomError", (e) => pageErrors.push(String((e && e.stack) || e)));
virtualConsole.on("error", (...args) => pageErrors.push(args.map(String).join(" ")));

const dom = await JSDOM.fromURL(url + "/ui", {
  runScripts: "dangerously",
  pretendToBeVisual: true,
  virtualConsole,
  beforeParse(window) {
    // jsdom has no fetch: the page gets Node's, with its relative URLs resolved against the
    // page's own as a browser resolves them, and Node's stream and abort classes to match.
    window.fetch = (input, init) => fetch(new URL(String(input), window.location.href), init);
    window.TextDecoder = TextDecoder;
    window.AbortController = AbortController;
  },
});
const { window } = dom;
const doc = window.document;
const $ = (id) => doc.getElementById(id);

async function until(what, predicate, timeoutMs = 60000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = predicate();
    if (value) return value;
    if (Date.now() > deadline) {
      throw new Error(`timed out waiting for ${what}; the page's status says: ` +
                      `${$("status").textContent}; page errors: ${pageErrors.join(" | ")}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

function rows() {
  return [...$("workers").tBodies[0].rows].map((tr) => {
    const cells = Object.fromEntries([...tr.cells].map((td) => [td.dataset.col, td.textContent]));
    return { ...cells, meter: tr.querySelector("meter") ? Number(tr.querySelector("meter").value) : null };
  });
}
function chart(name) {
  const figure = $("chart-" + name);
  const svg = figure.querySelector("svg");
  return { points: Number(svg.dataset.points || 0), paths: svg.querySelectorAll("path").length,
           rects: svg.querySelectorAll("rect").length,
           legend: figure.querySelector(".legend").textContent };
}
const polls = () => Number(doc.body.dataset.polls || 0);

// 1. Without a key the data endpoint refuses; the page says so and shows nothing.
const refused = await until("the page to ask for the key",
                            () => $("status").dataset.kind === "auth" && $("status").textContent);
const rowsBeforeKey = rows().length;

// 2. The key, pasted into the key box: the page polls again at once, and fills.
$("api-key").value = apiKey;
$("key-form").requestSubmit();
await until("two workers in the table", () => polls() >= 1 && rows().length >= 2);
const storedKey = window.sessionStorage.getItem("tandem.apiKey") === apiKey;

// 3. A chat, typed and sent: the answer streams into the page.
$("chat-max").value = "16";  // a random model rarely stops by itself
$("chat-temp").value = "0";  // greedy: the test compares the text with the API's own answer
$("chat-input").value = process.argv[5];
$("chat-form").requestSubmit();
const answer = await until("the streamed answer", () => {
  const out = doc.querySelector(".msg.assistant");
  return out && out.dataset.done !== "false" && out;
}, 120000);
const chat = { done: answer.dataset.done, text: answer.textContent,
               chunks: Number(answer.dataset.chunks || 0), stats: $("chat-stats").textContent,
               model: $("chat-model").value,
               messages: doc.querySelectorAll("#messages .msg").length };

// 4. The next polls chart the request, and the prefill worker's KV transfer reaches the table
// with the heartbeat after it.
await until("the TTFT chart to fill", () => chart("ttft").points >= 1 && chart("tokens").points >= 1);
await until("a KV transfer in the worker table",
            () => rows().some((r) => r.role === "prefill" && /^[1-9]\d* \//.test(r.transfers)));
const after = polls();
await until("one more poll", () => polls() > after);

console.log(JSON.stringify({
  refused, rowsBeforeKey, storedKey, rows: rows(), chat,
  charts: Object.fromEntries(["ttft", "itl", "tpot", "tokens"].map((n) => [n, chart(n)])),
  cards: { waiting: $("q-waiting").textContent, running: $("q-running").textContent,
           requests: $("w-requests").textContent },
  models: [...$("chat-model").options].map((o) => o.value),
  status: $("status").dataset.kind, pageErrors,
}));
window.close();
process.exit(0);  // nothing of the page may keep this process waiting
