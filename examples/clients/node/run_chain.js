// Run an InferX chain from Node.js and print each of its events as one JSON line.
// Usage: node run_chain.js ROUTER_HOST:PORT CHAIN KEY=VALUE...
// With INFERX_TLS_CA=ca.pem the call is TLS, verifying the router against that CA (what
// `make run` serves: .inferx/tls/ca.pem); with INFERX_TOKEN it sends
// `authorization: Bearer <token>`. Without INFERX_TLS_CA it is plaintext (--insecure stacks).
const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [router, chain, ...pairs] = process.argv.slice(2);
if (!router || !chain) {
  console.error("usage: node run_chain.js ROUTER_HOST:PORT CHAIN KEY=VALUE...");
  process.exit(2);
}
const protoRoot = path.resolve(__dirname, "../../../protos");
const definition = protoLoader.loadSync("inferx/v1/router.proto", {
  includeDirs: [protoRoot],
  keepCase: true,
  longs: Number,
  defaults: true,
  oneofs: true,
});
const inferx = grpc.loadPackageDefinition(definition).inferx.v1;
const credentials = process.env.INFERX_TLS_CA
  ? grpc.credentials.createSsl(fs.readFileSync(process.env.INFERX_TLS_CA))
  : grpc.credentials.createInsecure();
const client = new inferx.Router(router, credentials);
const metadata = new grpc.Metadata();
if (process.env.INFERX_TOKEN) metadata.set("authorization", `Bearer ${process.env.INFERX_TOKEN}`);

const inputs = {};
for (const pair of pairs) {
  const at = pair.indexOf("=");
  if (at < 1) {
    console.error(`bad input ${pair}: expected KEY=VALUE`);
    process.exit(2);
  }
  inputs[pair.slice(0, at)] = pair.slice(at + 1);
}

// batch_events: the router sends the events that are ready together in one message, the
// rest in `following`; printed one by one, they are the same events in the same order.
const call = client.RunChain({ chain, inputs, batch_events: true }, metadata);
call.on("data", (message) => {
  for (const event of [message, ...message.following]) {
    console.log(JSON.stringify({ ...event, following: undefined }));
  }
});
call.on("error", (err) => {
  console.error(`${grpc.status[err.code]}: ${err.details}`);
  process.exit(1);
});
call.on("end", () => process.exit(0));
