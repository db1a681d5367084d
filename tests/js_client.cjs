// Drives pensieve's server with the official JavaScript SDKs from npm, `@anthropic-ai/sdk` and
// `openai`, as Node programs (Claude Code's SDK, agent frameworks in TypeScript) call it;
// tests/server_js_clients.rs runs it and checks what it prints (one JSON object).
//
// Usage: node js_client.cjs BASE_URL anthropic
//        node js_client.cjs BASE_URL openai
// (NODE_PATH: the node_modules scripts/fetch-assets --tests installs.)

"use strict";

const Anthropic = require("@anthropic-ai/sdk").default;
const OpenAI = require("openai").default;

const MODEL = "pensieve";

const TOOLS = [
  {
    name: "read_file",
    description: "Read a file.",
    input_schema: {
      type: "object",
      properties: { path: { type: "string", maxLength: 40 } },
      required: ["path"],
      additionalProperties: false,
    },
  },
];

function usage(u) {
  return {
    input: u.input_tokens,
    output: u.output_tokens,
    cache_read: u.cache_read_input_tokens,
    cache_creation: u.cache_creation_input_tokens,
  };
}

// A chat resent whole, its system prompt marked for the cache, whole and streamed; its prompt
// counted; a tool loop that must call; a refused request.
async function anthropic(base) {
  const c = new Anthropic({ baseURL: base, apiKey: "unused", maxRetries: 0 });
  const system = [
    {
      type: "text",
      text:
        "You are a helpful assistant. " +
        Array.from({ length: 8 }, (_, i) => `Rule ${i}: answer briefly and plainly.`).join(" "),
      cache_control: { type: "ephemeral" },
    },
  ];
  const messages = [{ role: "user", content: "Name a color." }];
  const counted = await c.messages.countTokens({ model: MODEL, system, messages });
  const first = await c.messages.create({ model: MODEL, system, messages, max_tokens: 24 });
  messages.push({ role: "assistant", content: first.content });
  messages.push({ role: "user", content: "Name another one." });
  let deltas = 0;
  const stream = c.messages.stream({ model: MODEL, system, messages, max_tokens: 24 });
  stream.on("text", () => {
    deltas += 1;
  });
  const second = await stream.finalMessage();
  const agent = [{ role: "user", content: "The tests in main.py fail. Fix the bug." }];
  // The agent's turn on its history so far, under `toolChoice`.
  const agentTurn = (toolChoice, maxTokens) =>
    c.messages.create({
      model: MODEL,
      system: "You are a coding agent. Use the tools.",
      messages: agent,
      tools: TOOLS,
      tool_choice: toolChoice,
      max_tokens: maxTokens,
    });
  const call = await agentTurn({ type: "any" }, 64);
  const use = call.content.find((b) => b.type === "tool_use");
  agent.push({ role: "assistant", content: call.content });
  agent.push({
    role: "user",
    content: [{ type: "tool_result", tool_use_id: use.id, content: "def add(a, b): return a - b" }],
  });
  const answered = await agentTurn({ type: "none" }, 24);
  let refused = null;
  try {
    await c.messages.create({ model: "claude-opus-4", messages, max_tokens: 8 });
  } catch (e) {
    refused = { status: e.status, type: e.error && e.error.error && e.error.error.type };
  }
  return {
    counted: counted.input_tokens,
    first: { usage: usage(first.usage), stop: first.stop_reason, text: first.content[0].text },
    second: { usage: usage(second.usage), deltas, blocks: second.content.map((b) => b.type) },
    call: { stop: call.stop_reason, name: use.name, input: use.input },
    answered: { usage: usage(answered.usage), blocks: answered.content.map((b) => b.type) },
    refused,
  };
}

function responseUsage(r) {
  return {
    input: r.usage.input_tokens,
    cached: r.usage.input_tokens_details.cached_tokens,
    output: r.usage.output_tokens,
  };
}

// Chat completions whole and streamed; a stored response continued by its id; a compaction
// and the turn on its window.
async function openai(base) {
  const c = new OpenAI({ baseURL: base, apiKey: "unused", maxRetries: 0 });
  const chat = await c.chat.completions.create({
    model: MODEL,
    messages: [{ role: "user", content: "Name a color." }],
    max_tokens: 16,
    temperature: 0,
  });
  let chunks = 0;
  const stream = await c.chat.completions.create({
    model: MODEL,
    messages: [{ role: "user", content: "Name a color." }],
    max_tokens: 16,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
  });
  let streamed = "";
  for await (const chunk of stream) {
    chunks += 1;
    if (chunk.choices.length) streamed += chunk.choices[0].delta.content || "";
  }
  const instructions = "You are a helpful assistant. Answer in one sentence.";
  const r1 = await c.responses.create({
    model: MODEL,
    instructions,
    input: "My name is Ada. I write parsers.",
    max_output_tokens: 24,
    temperature: 0,
  });
  const r2 = await c.responses.create({
    model: MODEL,
    previous_response_id: r1.id,
    input: "What is my name?",
    max_output_tokens: 24,
    temperature: 0,
  });
  const compacted = await c.responses.compact({
    model: MODEL,
    previous_response_id: r2.id,
    instructions,
  });
  const after = await c.responses.create({
    model: MODEL,
    instructions,
    input: [...compacted.output, { role: "user", content: "And what do I write?" }],
    max_output_tokens: 24,
    temperature: 0,
    store: false,
  });
  return {
    chat: { text: chat.choices[0].message.content, usage: chat.usage },
    stream: { chunks, text: streamed },
    responses: [responseUsage(r1), responseUsage(r2)],
    text: r2.output_text,
    compacted: { object: compacted.object, types: compacted.output.map((o) => o.type) },
    after: responseUsage(after),
  };
}

async function main() {
  const [base, command] = process.argv.slice(2);
  const commands = { anthropic, openai };
  const out = await commands[command](base.replace(/\/$/, ""));
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((e) => {
  process.stderr.write(`${e.stack || e}\n`);
  process.exit(1);
});
