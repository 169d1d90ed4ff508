// Background mode through openai-node (the `openai` npm package), against the proxy
// named by OCXPROXY_BASE_URL: prints what it saw as one JSON object; the Python test
// (tests/http/test_background_node.py) checks it.
const { OpenAI } = require("openai");

const client = new OpenAI({
  baseURL: process.env.OCXPROXY_BASE_URL,
  apiKey: process.env.OPENAI_API_KEY,
  maxRetries: 0,
});

async function untilEnded(id) {
  for (let i = 0; i < 400; i++) {
    const polled = await client.responses.retrieve(id);
    if (polled.status !== "queued" && polled.status !== "in_progress") return polled;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  throw new Error(`${id} did not end`);
}

async function createAndPoll() {
  const created = await client.responses.create({ model: "m", input: "poll me", background: true });
  const done = await untilEnded(created.id);
  return { created: { id: created.id, status: created.status, background: created.background },
           done: { id: done.id, status: done.status, text: done.output_text } };
}

async function streamDropResume() {
  const stream = await client.responses.create({
    model: "m", input: "stream me", background: true, stream: true,
  });
  const first = [];
  for await (const event of stream) {
    first.push(event);
    if (first.length === 3) break; // the connection is dropped here
  }
  const id = first[0].response.id;
  const last = first[first.length - 1].sequence_number;
  const rest = [];
  for await (const event of await client.responses.retrieve(id, { stream: true, starting_after: last })) {
    rest.push(event);
  }
  const whole = [];
  for await (const event of await client.responses.retrieve(id, { stream: true })) whole.push(event);
  const helper = client.responses.stream({ response_id: id, starting_after: 5 });
  const helped = [];
  for await (const event of helper) helped.push(event.sequence_number);
  const final = await helper.finalResponse();
  return {
    first: first.map((e) => [e.sequence_number, e.type]),
    rest: rest.map((e) => [e.sequence_number, e.type]),
    same: JSON.stringify([...first, ...rest]) === JSON.stringify(whole),
    helped, final: final.output_text,
  };
}

async function cancelTwice() {
  const created = await client.responses.create({ model: "m", input: "slow", background: true });
  const cancelled = await client.responses.cancel(created.id);
  const again = await client.responses.cancel(created.id);
  const polled = await client.responses.retrieve(created.id);
  return { status: cancelled.status, same: JSON.stringify(cancelled) === JSON.stringify(again),
           polled: polled.status };
}

async function storeFalse() {
  try {
    await client.responses.create({ model: "m", input: "x", background: true, store: false });
    return { refused: false };
  } catch (error) {
    return { refused: error instanceof OpenAI.BadRequestError, status: error.status,
             param: error.param };
  }
}

async function main() {
  const seen = {
    poll: await createAndPoll(),
    resume: await streamDropResume(),
    cancel: await cancelTwice(),
    storeFalse: await storeFalse(),
  };
  process.stdout.write(JSON.stringify(seen));
}

main().catch((error) => {
  process.stderr.write(`${error.stack || error}\n`);
  process.exit(1);
});
