// The real Node `openai` package against a Switchyard server: a streamed chat completion with a
// forced tool call and `stream_options.include_usage`, assembled from the deltas as an SDK user
// does. Usage: node stream_tool_call.mjs BASE_URL API_KEY
// Prints one JSON line of what it saw; exits non-zero on any mismatch.
import OpenAI from "openai";

const [baseURL, apiKey] = process.argv.slice(2);
if (!baseURL || !apiKey) {
  console.error("usage: node stream_tool_call.mjs BASE_URL API_KEY");
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });

const tools = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The forecast for a city.",
      parameters: {
        type: "object",
        properties: {
          city: { type: "string" },
          days: { type: "integer", minimum: 1, maximum: 7 },
          unit: { type: "string", enum: ["celsius", "fahrenheit"] },
        },
        required: ["city", "days", "unit"],
      },
    },
  },
];

function check(cond, what) {
  if (!cond) throw new Error(`mismatch: ${what}`);
}

const stream = await client.chat.completions.create({
  model: "small",
  messages: [{ role: "user", content: "What is the weather in Lisbon?" }],
  tools,
  tool_choice: { type: "function", function: { name: "get_weather" } },
  seed: 7,
  max_tokens: 400,
  stream: true,
  stream_options: { include_usage: true },
});

const calls = new Map();
let finishReason = null;
let usage = null;
let chunks = 0;
let lastHadChoices = true;
for await (const chunk of stream) {
  chunks += 1;
  lastHadChoices = chunk.choices.length > 0;
  if (chunk.usage) usage = chunk.usage;
  for (const choice of chunk.choices) {
    for (const tc of choice.delta.tool_calls ?? []) {
      const call = calls.get(tc.index) ?? { id: null, name: "", arguments: "" };
      if (tc.id) call.id = tc.id;
      if (tc.function?.name) call.name += tc.function.name;
      if (tc.function?.arguments) call.arguments += tc.function.arguments;
      calls.set(tc.index, call);
    }
    if (choice.finish_reason) finishReason = choice.finish_reason;
  }
}

check(calls.size === 1 && calls.has(0), `one tool call at index 0: ${JSON.stringify([...calls])}`);
const call = calls.get(0);
const args = JSON.parse(call.arguments);
check(typeof args.city === "string", `city is a string: ${call.arguments}`);
check(Number.isInteger(args.days) && args.days >= 1 && args.days <= 7, `days in 1..7: ${call.arguments}`);
check(["celsius", "fahrenheit"].includes(args.unit), `unit in the enum: ${call.arguments}`);
check(usage && !lastHadChoices, "usage arrives in a last chunk without choices");

console.log(
  JSON.stringify({
    id: call.id,
    name: call.name,
    args,
    finish_reason: finishReason,
    usage: { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens },
    chunks,
  }),
);
