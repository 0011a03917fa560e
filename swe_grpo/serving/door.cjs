// The sandbox side of a rollout's door (swe_grpo/serving/door.py). Run by the bundle's Node inside the sandbox's
// own network namespace: `node door.cjs PORT SOCKET [PROXY_PORT PROXY_SOCKET] -- CMD ARGS...` listens on
// 127.0.0.1:PORT (and PROXY_PORT), pipes every connection to SOCKET (PROXY_SOCKET): unix sockets on the
// host, bind-mounted in. Once listening it runs CMD (the agent) with this process's stdio, and with
// HTTPS_PROXY/HTTP_PROXY set to the proxy port if there is one; it exits with the agent's status. No HTTP
// parsing here: the host side checks every request.
"use strict";
const net = require("net");
const os = require("os");
const { spawn } = require("child_process");

const argv = process.argv.slice(2);
const split = argv.indexOf("--");
const [port, socketPath, proxyPort, proxySocket] = argv.slice(0, split);
const [cmd, ...args] = argv.slice(split + 1);

function listen(listenPort, target) {
  const server = net.createServer((client) => {
    const upstream = net.connect(target);
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
    console.error(`door: cannot listen on 127.0.0.1:${listenPort}: ${e.message}`);
    process.exit(125);
  });
  return new Promise((resolve) => server.listen(Number(listenPort), "127.0.0.1", resolve));
}

const env = { ...process.env };
if (proxyPort) {
  env.HTTPS_PROXY = env.HTTP_PROXY = env.https_proxy = env.http_proxy = `http://127.0.0.1:${proxyPort}`;
  env.NO_PROXY = env.no_proxy = "127.0.0.1,localhost";
}
Promise.all([listen(port, socketPath), ...(proxyPort ? [listen(proxyPort, proxySocket)] : [])]).then(() => {
  const agent = spawn(cmd, args, { stdio: "inherit", env });
  agent.on("error", (e) => {
    console.error(`door: cannot run ${cmd}: ${e.message}`);
    process.exit(127);
  });
  agent.on("exit", (code, signal) => process.exit(code ?? 128 + os.constants.signals[signal]));
});
