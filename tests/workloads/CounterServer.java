// java CounterServer ADDR: the "counter protocol" HTTP server of
// tests/tests/daemons.rs on a JVM with many threads: the JDK's HttpServer
// with a pool of 16 handler threads, 24 threads extending hash chains and
// allocating (so the garbage collector works too), plus the JVM's own.
// Run in the foreground as a systemd service would run it; SIGTERM stops
// it (the JVM exits 143 after its shutdown hooks).
//
//   GET /add/KEY/N  adds N to KEY, answers its new value
//   GET /sum        "KEYS TOTAL ADDS" over all keys
//   GET /check      "OK ..." if the server's own state is consistent: the
//                   values add up to the total, and every chain recomputes
//                   to the same digest; "FAIL ..." otherwise
import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import java.io.IOException;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.Executors;

public class CounterServer {
    static final int CHAINS = 24;

    static final class Chain {
        final int id;
        long n;
        byte[] hash = new byte[32];

        Chain(int id) {
            this.id = id;
        }

        static byte[] step(byte[] h, int id, long n) {
            try {
                MessageDigest d = MessageDigest.getInstance("SHA-256");
                d.update(h);
                d.update((id + "/" + n).getBytes(StandardCharsets.UTF_8));
                return d.digest();
            } catch (Exception e) {
                throw new RuntimeException(e);
            }
        }

        synchronized void step() {
            n++;
            hash = step(hash, id, n);
        }

        String verify() {
            long m;
            byte[] h;
            synchronized (this) {
                m = n;
                h = hash.clone();
            }
            byte[] x = new byte[32];
            for (long i = 1; i <= m; i++) x = step(x, id, i);
            return Arrays.equals(x, h) ? null : "chain " + id + " differs after " + m + " steps";
        }
    }

    static final Map<String, Long> vals = new HashMap<>();
    static long total, adds;
    static final List<Chain> chains = new ArrayList<>();

    static void answer(HttpExchange ex, int code, String s) throws IOException {
        byte[] b = s.getBytes(StandardCharsets.UTF_8);
        ex.sendResponseHeaders(code, b.length);
        try (OutputStream o = ex.getResponseBody()) {
            o.write(b);
        }
    }

    static String check() {
        long sum = 0, t;
        int keys;
        synchronized (vals) {
            for (long v : vals.values()) sum += v;
            t = total;
            keys = vals.size();
        }
        if (sum != t) return "FAIL values add up to " + sum + ", total " + t;
        for (Chain c : chains) {
            String err = c.verify();
            if (err != null) return "FAIL " + err;
        }
        return "OK " + keys + " keys, " + CHAINS + " chains verified, "
                + Thread.activeCount() + " threads";
    }

    public static void main(String[] args) throws Exception {
        String[] hp = args[0].split(":");
        for (int i = 0; i < CHAINS; i++) {
            Chain c = new Chain(i);
            chains.add(c);
            Thread t = new Thread(() -> {
                List<byte[]> garbage = new ArrayList<>();
                while (true) {
                    c.step();
                    garbage.add(new byte[4096]);
                    if (garbage.size() > 256) garbage.clear();
                    try {
                        Thread.sleep(5);
                    } catch (InterruptedException e) {
                        return;
                    }
                }
            }, "chain-" + i);
            t.setDaemon(true);
            t.start();
        }
        HttpServer server = HttpServer.create(
                new InetSocketAddress(hp[0], Integer.parseInt(hp[1])), 64);
        server.setExecutor(Executors.newFixedThreadPool(16));
        server.createContext("/", ex -> {
            String[] p = ex.getRequestURI().getPath().split("/");
            if (p.length == 4 && p[1].equals("add")) {
                long n = Long.parseLong(p[3]);
                long v;
                synchronized (vals) {
                    v = vals.getOrDefault(p[2], 0L) + n;
                    vals.put(p[2], v);
                    total += n;
                    adds++;
                }
                answer(ex, 200, Long.toString(v));
            } else if (p.length == 2 && p[1].equals("sum")) {
                String s;
                synchronized (vals) {
                    s = vals.size() + " " + total + " " + adds;
                }
                answer(ex, 200, s);
            } else if (p.length == 2 && p[1].equals("check")) {
                answer(ex, 200, check());
            } else {
                answer(ex, 400, "bad path");
            }
        });
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            server.stop(0);
            System.out.println("stopped");
        }));
        server.start();
        System.out.println("listening on " + args[0]);
    }
}
