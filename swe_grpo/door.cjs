// The sandbox side of a rollout's door (swe_grpo/door.py). Run by the bundle's Node inside the sandbox's
// own network namespace: `node door.cjs PORT SOCKET CMD ARGS...` listens on 127.0.0.1:PORT, pipes every
// connection to SOCKET (the rollout's unix socket on the InterceptionServer, bind-mounted in), and once
// listening runs CMD (the agent) with this process's stdio; it exits with the agent's status. No HTTP
// parsing here: the server checks the rollout id and the token of every request.
"use strict";
const net = require("net");
const os = require("os");
const { spawn } = require("child_process");

const [port, socketPath, cmd, ...args] = process.argv.slice(2);
const server = net.createServer((client) => {
  const upstream = net.connect(socketPath);
  client.setNoDelay(true);
  const close = () => {
    client.destroy();
    upstream.destroy();
  };
  for (const end of [client, upstream]) {
    end.on("error", close);
    end.on("close", close);
  }
  client.pipe(upstream).pipe(client);
});
server.on("error", (e) => {
  console.error(`door: cannot listen on 127.0.0.1:${port}: ${e.message}`);
  process.exit(125);
});
server.listen(Number(port), "127.0.0.1", () => {
  const agent = spawn(cmd, args, { stdio: "inherit" });
  agent.on("error", (e) => {
    console.error(`door: cannot run ${cmd}: ${e.message}`);
    process.exit(127);
  });
  agent.on("exit", (code, signal) => process.exit(code ?? 128 + os.constants.signals[signal]));
});
