%% convoy's benchmark harness: the command line and the top of a run.
%%
%% `bin/convoy-bench' (and `make bench') starts a distributed node and calls
%% `cli/0'; tests call `main/1' with the same arguments. A run starts its own peer
%% nodes (see `convoy_bench_nodes'), runs each scenario's variants interleaved and
%% repeated (`convoy_bench_runner'), prints the configuration and a seed-style
%% table, and writes results.json, results.csv and plots under
%% bench/results/<timestamp>/ (`convoy_bench_report').
-module(convoy_bench).

-export([cli/0, main/1, exit_status/1, usage/0, parse/1, variants/1, convoy_variant/2]).

-type opts() :: map().
-export_type([opts/0]).

%% @doc Entry point of `bin/convoy-bench': arguments after `-extra'; halts with 0,
%% 1 when `--check' found cells outside tolerance, 2 for bad arguments or a failed
%% run, 3 if the harness crashed.
-spec cli() -> no_return().
cli() ->
    Status = try main(init:get_plain_arguments()) of
                 {error, Why} = E ->
                     io:format(standard_error, "convoy-bench: ~s~n", [Why]),
                     exit_status(E);
                 Ok ->
                     exit_status(Ok)
             catch
                 Class:Reason:Stack ->
                     io:format(standard_error, "convoy-bench crashed: ~p:~p~n~p~n",
                               [Class, Reason, Stack]),
                     3
             end,
    erlang:halt(Status, [{flush, true}]).

%% @doc The exit status of a `main/1' result: 1 when `--check' found cells outside
%% tolerance, 2 for an error, 0 otherwise.
-spec exit_status({ok, map()} | {error, binary()}) -> 0 | 1 | 2.
exit_status({ok, #{check := #{within := N, cells := M}}}) when N < M -> 1;
exit_status({ok, _}) -> 0;
exit_status({error, _}) -> 2.

%% @doc Run the harness with command-line `Args'. Returns the whole result (what
%% results.json holds, plus `dir' and `files'), `#{help := Text}' for `--help',
%% or an error naming the bad argument.
-spec main([string()]) -> {ok, map()} | {error, binary()}.
main(Args) ->
    case parse(Args) of
        {error, _} = E ->
            E;
        {ok, #{command := help}} ->
            io:put_chars(usage()),
            {ok, #{help => iolist_to_binary(usage())}};
        {ok, #{command := page} = Opts} ->
            convoy_bench_page:run(Opts);
        {ok, Opts0} ->
            Opts = Opts0#{argv => Args},
            case prepare_node(Opts) of
                ok when map_get(command, Opts) =:= cost -> convoy_bench_cost:run(Opts);
                ok -> run(Opts);
                {error, _} = E -> E
            end
    end.

%% @doc The `--help' text.
-spec usage() -> iolist().
usage() ->
    Names = lists:join(",", [atom_to_list(N) || N <- convoy_bench_scenarios:names()]),
    Quick = lists:join(",", [atom_to_list(N) || N <- convoy_bench_scenarios:default_selection()]),
    ["usage: bin/convoy-bench [tune SCENARIO] [options]      (or: make bench ARGS=\"...\")\n"
     "       bin/convoy-bench cost [--tiny]   what one convoy:send/2 costs, step by step\n"
     "       bin/convoy-bench page DIR [--also DIR2]... [--charts CHARTS]   a run's\n"
     "                      results as a Markdown page on stdout (bench/RESULTS.md is\n"
     "                      one); each --also run follows with its own command and host;\n"
     "                      --charts copies the first run's charts to CHARTS and links\n"
     "                      them from the page\n"
     "\n"
     "Compares convoy with plain distribution on nodes the harness starts itself (OTP\n"
     "peer nodes, connected over distribution; the harness node only coordinates).\n"
     "Every scenario runs all its variants in the same run, interleaved, repeated;\n"
     "cells are median [min - max]; \"x base\" is the median of the per-repeat ratios\n"
     "variant/base; convoy's rows also show \"x best flag\" (over the better of\n"
     "nodelay_false and delay_send in the same repeat), \"x handover\" and \"x ceiling\"\n"
     "where those ran. Progress goes to stderr, the table to stdout, files to the\n"
     "results directory: table.txt, results.csv, results.json, *.png (gnuplot).\n"
     "\n"
     "Scenarios: ", Names, "\n"
     "  local    seed 002: same-node oneway and ping-pong rates\n"
     "  flood    seeds 000/001: 200k spawned pingers + one pong, msg/min and ns/msg;\n"
     "           the seed's {ping, Pid} and the event shape\n"
     "  oneway   one sender, 1 M messages to a remote process, msg/s and ns/msg\n"
     "           (the sender's time per message); an atom, the event and the\n"
     "           phoenix shape\n"
     "  oneway8  8 senders at once, 125 k messages each to their own remote process\n"
     "  sizes    one-way msg/s and MB/s, 16 B .. 1 MB\n"
     "  large    one sender, 15 k {msg, {big, Bin}} (Bin 64 KiB) to a remote process\n"
     "           with a default mailbox, msg/s\n"
     "  pairs    1..1024 request/response pairs: rt/s and p50/p99/p99.9; the event\n"
     "           shape at 1, 4, 64 and 256 pairs, and at 16 and 64 pairs 0-2 ms apart\n"
     "           (each client waits a random 0 to 2 x pace_ms after each answer)\n"
     "  latency  idle round trip percentiles\n"
     "  cast     64 senders casting to a remote gen_server, msg/s\n"
     "           (gen_server:cast vs convoy:cast; the event shape)\n"
     "  call     1, 16 and 256 callers of a remote gen_server: calls/s,\n"
     "           p50/p99/p99.9 (gen_server:call vs convoy:call; the event shape)\n"
     "  bulk     seed 003: 10 MB binaries, 1 and 16 senders, MB/s\n"
     "  hol      small round trips while 4 senders push 10 MB binaries (p99)\n"
     "  fanout   one message to 10,000 processes on two remote nodes\n"
     "           (convoy:multicast vs Manifold.send vs a loop of sends), from 1\n"
     "           and 100 senders, and from 100 senders each to its own 100\n"
     "  publish  a pg group of 10,000 members on two remote nodes, 1 and 100\n"
     "           senders (convoy:publish vs the better of a loop of sends over\n"
     "           pg:get_members and a dispatcher per node, Phoenix.PubSub's way)\n"
     "  pubsub   Phoenix.PubSub, one topic, 10 subscribers on each of two remote\n"
     "           nodes, 1, 16 and 256 publishers: PG2 adapter vs Phoenix.PubSub.Convoy\n"
     "           (needs `make phoenix-build`; skipped, with a note, without it)\n"
     "  flow     seed 004: a slow consumer, flooded, synced every 1000, or fed\n"
     "           through a convoy_channel (window 1000); same node and 2 nodes\n"
     "  mesh     2, 4 and 6 nodes, each sending to a receiver on every other one\n"
     "           at once: msg/s in all and per node\n"
     "  The event shape is a realistic message, {event, Id, <<\"user-42\">>, #{k => Id}}\n"
     "  (Id: the message's sequence number; pairs: #{k => Id, body => Payload}); the\n"
     "  point label names the shape, e.g. \"1000000 msgs, atom\" / \"1000000 msgs, event\".\n"
     "  The phoenix shape (oneway, oneway8) is a Phoenix.PubSub broadcast's map of ten\n"
     "  binary keys with a payload map inside, about 420 bytes, its Id inside.\n"
     "\n"
     "Variants: local (`!` on one node), local_call (the local scenario only: `!` on\n"
     "one node behind one call to another module's function, what calling any\n"
     "library's send costs), plain (`!`), ceiling (oneway, oneway8, sizes,\n"
     "flood: a batching router with no bookkeeping; senders of many messages batch\n"
     "them themselves, lists of max_batch entries), handover (oneway, oneway8,\n"
     "flood, cast, pubsub: each message handed to one bare batching process per\n"
     "node, which ships lists of up to 1000 to a deliverer on the peer when its\n"
     "mailbox drains; the limit of a design that hands each message to a process),\n"
     "guarded (only when named; where handover runs but pubsub: the same hand-over\n"
     "with only the sender's per-message work convoy's promises need: settings read,\n"
     "size, marker, an exact bound), send_many (oneway, oneway8: convoy, the sender\n"
     "handing its messages over in lists of max_batch with convoy:send_many/1),\n"
     "batch (oneway, oneway8, pairs, latency: convoy's sends inside convoy:batch/1,\n"
     "a stream's in scopes of max_batch sends, every other send in a scope of its\n"
     "own, both ways; its rows also show \"x convoy\" and \"x send_many\"),\n"
     "nodelay_false (`!`, both nodes with -kernel dist_nodelay false), delay_send\n"
     "(`!`, both nodes with {delay_send,true} in inet_dist_connect/listen_options),\n"
     "manifold (fanout only: discord/manifold's Manifold.send/2, convoy off; needs\n"
     "`make manifold-build`, else reported unavailable; convoy's rows in fanout also\n"
     "show \"x manifold\"), convoy (defaults), and one per --convoy option (its\n"
     "rows also show \"x convoy\": against the defaults in the same repeat); in\n"
     "pubsub only pg2 (Phoenix.PubSub.PG2, the baseline there), handover\n"
     "(Phoenix.PubSub.Convoy's workers, each remote part of a broadcast handed to\n"
     "that batching process) and the convoy ones (Phoenix.PubSub.Convoy). Each flag\n"
     "family has its own pair of peer nodes.\n"
     "plain_again (`!` again, beside plain; only with --noise or when named) measures\n"
     "the run's own noise.\n"
     "\n"
     "Options:\n"
     "  --scenario a,b      scenarios to run (default: ", Quick, "); 'all' = every one\n"
     "  --full              every scenario (same as --scenario all)\n"
     "  --quick, --tiny     very small sizes: a smoke test in seconds, not a measurement\n"
     "  --repeat N          runs per variant, interleaved (default 3)\n"
     "  --convoy k=v,...    add a convoy variant with these settings, e.g.\n"
     "                      --convoy max_batch=5000,lanes=2 (repeatable); keys: lanes,\n"
     "                      max_batch, max_delay (us), large_threshold (bytes|infinity),\n"
     "                      barrier_timeout (ms), bypass_after (us|never), max_buffered,\n"
     "                      max_buffered_bytes (n|infinity), overload (block|drop|error),\n"
     "                      block_timeout (ms), telemetry (true|false), chunk_threshold\n"
     "                      (bytes|infinity), chunk_bytes, chunk_window,\n"
     "                      max_reassembly_bytes (bytes|infinity), compress\n"
     "                      (never|auto|1..9, e.g. --convoy compress=auto): see README\n"
     "  --variants a,b      run only these variants (names as printed)\n"
     "  --param k=v         override a scenario parameter, e.g. --param pingers=50000,\n"
     "                      --param n=200000 (repeatable; see results.json 'params')\n"
     "  --param deadline_ms=N  every point's deadline (default per scenario, 20 s to\n"
     "                      60 s; 20 s with --tiny): a measurement still running then is\n"
     "                      killed, reported FAILED (note \"deadline N ms\") and its nodes\n"
     "                      are replaced (given nodes: its processes killed, convoy\n"
     "                      restarted); the run carries on\n"
     "  --tune SCENARIO     sweep lanes, max_batch, max_delay and large_threshold for\n"
     "  tune SCENARIO       SCENARIO (one knob at a time, keeping the best so far),\n"
     "                      then measure the best against plain and the defaults and\n"
     "                      print the gain and the sys.config snippet\n"
     "  --nodes a@h,b@h[,c@h]  measure on running nodes instead of starting peers: A\n"
     "                      drives, B (and C, for fanout and publish) receive. They must share the\n"
     "                      harness's cookie (--cookie) and run OTP 25+; the harness\n"
     "                      loads its own modules there, and convoy's too if the node\n"
     "                      cannot load convoy itself (start them with -pa\n"
     "                      _build/bench/lib/convoy/ebin to use your build). Variants\n"
     "                      that need node flags (nodelay_false, delay_send) are skipped.\n"
     "                      Long node names (a@host.domain) make the harness use -name.\n"
     "  --cookie C          cookie for --nodes\n"
     "  --netns             (root, bin/convoy-bench only) run A and B (and C) in their\n"
     "                      own network namespaces joined by a veth pair (10.77.0.1 and\n"
     "                      10.77.0.2, long names); everything is removed afterwards\n"
     "  --rate R            with --netns: cap the veth at R with tc tbf, e.g. 1gbit\n"
     "                      (netem delay/loss is not available on this machine);\n"
     "                      sizes then sends what the link carries in 2 s per point\n"
     "                      (--link-rate R, which --rate passes on, does that alone)\n"
     "  --peer-args \"...\"   extra emulator flags for every peer node, e.g. \"+S 1\"\n"
     "  --out DIR           results directory (default bench/results/<timestamp>)\n"
     "  --no-plots          do not run gnuplot\n"
     "  --check             after the tables, compare every convoy cell with the baseline\n"
     "                      of its scenario (plain; local on one node), median of the\n"
     "                      per-repeat ratios: throughput (msg/s, rt/s, MB/s, deliveries/s,\n"
     "                      msg/min) must be >= 0.95x, p50 <= 1.10x, p99 <= 1.25x; a FAILED\n"
     "                      or unmeasured cell, or one without a ratio, is outside. Prints\n"
     "                      \"convoy vs plain: N of M cells within tolerance\" and the failing\n"
     "                      cells, writes them to results.json ('check'), and exits 1 when\n"
     "                      N < M. Works with --full, --scenario, --variants, tune, ...\n"
     "  --confirm N         with --check: each scenario with cells outside tolerance runs\n"
     "                      again at those points, baseline and convoy variants only, N\n"
     "                      more repeats (default 3; 0: none); the cells are judged on all\n"
     "                      their repeats, and the table names the re-measured ones\n"
     "  --noise             adds the variant plain_again: `!` run again, interleaved\n"
     "                      with the others. With --check, its cells are judged against\n"
     "                      plain with the same tolerances (and get the same second\n"
     "                      look), printed as \"plain_again vs plain: N of M cells within\n"
     "                      tolerance\": how many of convoy's cells the run's noise alone\n"
     "                      would put outside; each failing convoy cell shows `!`\n"
     "                      against itself there (column \"! again\"). The exit status\n"
     "                      stays convoy's.\n"
     "  --quiet             no progress on stderr and no table on stdout\n"
     "  --help              this text\n"].

%%--------------------------------------------------------------------
%% Arguments

defaults() ->
    #{command => bench, scenarios => default, size => normal, repeat => 3,
      convoy => [], only => all, params => #{}, nodes => none, cookie => undefined,
      out => undefined, plots => true, peer_args => [], quiet => false,
      nodes_note => undefined, check => false, confirm => 3, noise => false,
      charts => undefined, also => []}.

%% @doc Parse command-line arguments.
-spec parse([string()]) -> {ok, opts()} | {error, binary()}.
parse(Args) ->
    try
        {ok, check(parse(Args, defaults()))}
    catch
        throw:{bad_arg, Fmt, A} -> {error, iolist_to_binary(io_lib:format(Fmt, A))}
    end.

parse([], O) -> O;
parse(["cost" | R], O) -> parse(R, O#{command => cost});
parse(["page", Dir | R], O) -> parse(R, O#{command => page, page => Dir});
parse(["--charts", Dir | R], O) -> parse(R, O#{charts => Dir});
parse(["--also", Dir | R], O = #{also := Also}) -> parse(R, O#{also => Also ++ [Dir]});
parse(["tune", S | R], O) -> parse(R, O#{command => tune, tune => scenario(S)});
parse(["--tune", S | R], O) -> parse(R, O#{command => tune, tune => scenario(S)});
parse(["--help" | _], O) -> O#{command => help};
parse(["-h" | _], O) -> O#{command => help};
parse(["--scenario", S | R], O) -> parse(R, O#{scenarios => scenarios(S)});
parse(["--scenarios", S | R], O) -> parse(R, O#{scenarios => scenarios(S)});
parse(["--full" | R], O) -> parse(R, O#{scenarios => convoy_bench_scenarios:names()});
parse(["--quick" | R], O) -> parse(R, O#{size => tiny});
parse(["--tiny" | R], O) -> parse(R, O#{size => tiny});
parse(["--repeat", N | R], O) -> parse(R, O#{repeat => pos_int("--repeat", N)});
parse(["--convoy", S | R], O = #{convoy := C}) -> parse(R, O#{convoy => C ++ [settings(S)]});
parse(["--variants", S | R], O) -> parse(R, O#{only => variant_names(S)});
parse(["--param", S | R], O = #{params := P}) -> parse(R, O#{params => maps:merge(P, param(S))});
parse(["--nodes", S | R], O) -> parse(R, O#{nodes => node_list(S)});
parse(["--cookie", C | R], O) -> parse(R, O#{cookie => list_to_atom(C)});
parse(["--out", D | R], O) -> parse(R, O#{out => D});
parse(["--no-plots" | R], O) -> parse(R, O#{plots => false});
parse(["--quiet" | R], O) -> parse(R, O#{quiet => true});
parse(["--check" | R], O) -> parse(R, O#{check => true});
parse(["--noise" | R], O) -> parse(R, O#{noise => true});
parse(["--confirm", N | R], O) -> parse(R, O#{confirm => non_neg_int("--confirm", N)});
parse(["--peer-args", A | R], O) -> parse(R, O#{peer_args => string:lexemes(A, " ")});
parse(["--nodes-note", N | R], O) -> parse(R, O#{nodes_note => list_to_binary(N)});
parse(["--link-rate", Rate | R], O = #{params := P}) ->
    parse(R, O#{params => P#{link_rate => link_rate(Rate)}});
parse(["--netns" | _], _O) ->
    throw({bad_arg, "--netns is handled by bin/convoy-bench (it sets up the namespaces, "
          "then runs the harness with --nodes)", []});
parse(["--rate" | _], _O) ->
    throw({bad_arg, "--rate goes with --netns, handled by bin/convoy-bench", []});
parse([Opt | _], _O) ->
    throw({bad_arg, "unknown or incomplete argument: ~s (see --help)", [Opt]}).

check(O = #{command := tune, tune := S}) ->
    case convoy_bench_scenarios:spec(S, tiny, #{}) of
        #{convoy := {awaiting, _}} ->
            throw({bad_arg, "cannot tune ~s: its convoy variant awaits flow control (issue 4)",
                   [S]});
        _ -> O
    end;
check(O = #{only := Only}) when Only =/= all ->
    Known = [N || #{name := N} <- all_variants(maps:get(convoy, O))],
    case Only -- Known of
        [] -> O;
        Unknown -> throw({bad_arg, "--variants: unknown ~s; known: ~s",
                          [lists:join(",", Unknown), lists:join(",", Known)]})
    end;
check(O) -> O.

csv(S) -> string:lexemes(S, ",").

%% `--variants' names, split at the commas outside brackets: a variant with
%% several settings is named as printed, e.g. "plain,convoy[lanes=2,max_batch=500]".
variant_names(S) ->
    variant_names(S, 0, [], []).

variant_names([], _Depth, Name, Names) ->
    lists:reverse(add_name(Name, Names));
variant_names([$, | R], 0, Name, Names) ->
    variant_names(R, 0, [], add_name(Name, Names));
variant_names([C | R], Depth, Name, Names) ->
    Deeper = case C of
                 $[ -> Depth + 1;
                 $] -> max(Depth - 1, 0);
                 _ -> Depth
             end,
    variant_names(R, Deeper, [C | Name], Names).

add_name([], Names) -> Names;
add_name(Name, Names) -> [list_to_binary(lists:reverse(Name)) | Names].

scenarios("all") -> convoy_bench_scenarios:names();
scenarios(S) -> [scenario(N) || N <- csv(S)].

scenario(S) ->
    Known = convoy_bench_scenarios:names(),
    case [N || N <- Known, atom_to_list(N) =:= S] of
        [N] -> N;
        [] -> throw({bad_arg, "unknown scenario ~s; known: ~s",
                     [S, lists:join(",", [atom_to_list(N) || N <- Known])]})
    end.

pos_int(Opt, S) -> int_from(1, "a positive", Opt, S).

non_neg_int(Opt, S) -> int_from(0, "a non-negative", Opt, S).

int_from(Min, What, Opt, S) ->
    case string:to_integer(S) of
        {N, ""} when N >= Min -> N;
        _ -> throw({bad_arg, "~s needs ~s integer, not ~s", [Opt, What, S]})
    end.

%% "max_batch=5000,lanes=2" -> {"max_batch=5000,lanes=2", #{...}}, validated by
%% convoy's own settings validator.
settings(S) ->
    Pairs = [kv("--convoy", KV) || KV <- csv(S)],
    Map = maps:from_list([{setting_key(K), setting_value(V)} || {K, V} <- Pairs]),
    case convoy_config:validate(Map) of
        {ok, _} -> {list_to_binary(lists:join(",", [[K, "=", V] || {K, V} <- Pairs])), Map};
        {error, Why} -> throw({bad_arg, "--convoy ~s: ~p", [S, Why]})
    end.

setting_key(K) ->
    case [A || A <- convoy_config:keys(), atom_to_list(A) =:= K] of
        [A] -> A;
        [] -> throw({bad_arg, "--convoy: unknown setting ~s; known: ~s",
                     [K, lists:join(",", [atom_to_list(A) || A <- convoy_config:keys()])]})
    end.

setting_value("infinity") -> infinity;
setting_value("true") -> true;
setting_value("false") -> false;
setting_value(V) ->
    case string:to_integer(V) of
        {N, ""} -> N;
        _ ->
            %% never, block, drop, error: atoms convoy_config knows (validated there)
            try list_to_existing_atom(V)
            catch error:badarg -> throw({bad_arg, "--convoy: bad value ~s", [V]})
            end
    end.

%% A tc rate ("100mbit", "1gbit", "500kbit", "8000bit") as bytes/s.
link_rate(Rate) ->
    case re:run(Rate, "^([0-9]+)(bit|kbit|mbit|gbit)$", [{capture, all_but_first, list}]) of
        {match, [N, Unit]} ->
            Bits = list_to_integer(N) * proplists:get_value(Unit, [{"bit", 1}, {"kbit", 1000},
                                                               {"mbit", 1000000},
                                                               {"gbit", 1000000000}]),
            max(1, Bits div 8);
        nomatch ->
            throw({bad_arg, "--link-rate: ~s is not a rate such as 100mbit or 1gbit", [Rate]})
    end.

param(S) ->
    {K, V} = kv("--param", S),
    Known = lists:usort(lists:append([convoy_bench_scenarios:param_keys(N)
                                      || N <- convoy_bench_scenarios:names()])),
    case [A || A <- Known, atom_to_list(A) =:= K] of
        [A] -> #{A => pos_int("--param " ++ K, V)};
        [] -> throw({bad_arg, "--param: unknown parameter ~s; known: ~s",
                     [K, lists:join(",", [atom_to_list(A) || A <- Known])]})
    end.

kv(Opt, S) ->
    case string:split(S, "=") of
        [K, V] when K =/= "", V =/= "" -> {K, V};
        _ -> throw({bad_arg, "~s wants key=value, not ~s", [Opt, S]})
    end.

node_list(S) ->
    case [list_to_atom(N) || N <- csv(S)] of
        Ns when length(Ns) >= 2 -> Ns;
        _ -> throw({bad_arg, "--nodes wants at least two nodes: a@host,b@host[,c@host]", []})
    end.

%%--------------------------------------------------------------------
%% A run

prepare_node(#{cookie := Cookie}) ->
    Alive = case is_alive() of
                true -> ok;
                false ->
                    Name = list_to_atom("convoy_bench_" ++ os:getpid()),
                    case net_kernel:start([Name, shortnames]) of
                        {ok, _} -> ok;
                        {error, Why} ->
                            {error, iolist_to_binary(
                                      io_lib:format("cannot start distribution (~p); is "
                                                    "epmd running?", [Why]))}
                    end
            end,
    Cookie =:= undefined orelse erlang:set_cookie(Cookie),
    Alive.

run(Opts = #{quiet := Quiet}) ->
    T0 = erlang:monotonic_time(),
    RunOpts = #{repeat => maps:get(repeat, Opts), progress => not Quiet, t0 => T0},
    Variants = variants(Opts),
    Nodes0 = convoy_bench_nodes:new(#{given => maps:get(nodes, Opts),
                                      peer_args => maps:get(peer_args, Opts)}),
    {Outcome, NodesEnd} =
        try
            {[A | _], Nodes1} = convoy_bench_nodes:prepare(default, 2, off, Nodes0),
            Facts = convoy_bench_nodes:facts(A),
            print_header(Opts, Facts, Variants),
            {Body, Nodes2} = body(Opts, Variants, RunOpts, Nodes1),
            {{ok, Facts, Body}, Nodes2}
        catch
            Class:Reason:Stack ->
                {{error, iolist_to_binary(io_lib:format("~p:~0p~n~p", [Class, Reason, Stack]))},
                 Nodes0}
        end,
    ok = convoy_bench_nodes:stop(NodesEnd),
    case Outcome of
        {error, _} = E -> E;
        {ok, Facts1, Body1} -> finish(Opts, Facts1, Body1, T0)
    end.

%% The configuration goes to stderr at once, so a long run shows what it measures.
print_header(#{quiet := true}, _Facts, _Variants) ->
    ok;
print_header(Opts, Facts, Variants) ->
    Config = config(Opts, Facts, Variants, 0.0),
    io:put_chars(standard_error, convoy_bench_report:config_text(Config)).

config(Opts, Facts, Variants, Secs) ->
    #{facts => Facts, started => timestamp(human),
      args => [list_to_binary(A) || A <- maps:get(argv, Opts)],
      repeat => maps:get(repeat, Opts), size => maps:get(size, Opts),
      variants => [describe_variant(V) || V <- Variants],
      nodes => nodes_note(Opts), plots => maps:get(plots, Opts),
      harness_node => node(), seconds => Secs, commit => commit()}.

%% The commit of the checkout the harness runs in, `+' when src/ or bench/ differ
%% from it; `null' outside a git checkout.
commit() ->
    Head = string:trim(os:cmd("git rev-parse --short HEAD 2>/dev/null")),
    case Head =/= "" andalso lists:all(fun is_hex/1, Head) of
        true ->
            case os:cmd("git status --porcelain -- src bench 2>/dev/null") of
                "" -> list_to_binary(Head);
                _ -> list_to_binary(Head ++ "+")
            end;
        false ->
            null % not a git checkout (git's error is not a commit, though `f' starts both)
    end.

is_hex(C) -> (C >= $0 andalso C =< $9) orelse (C >= $a andalso C =< $f).

body(Opts = #{command := bench, scenarios := Sel}, Variants, RunOpts, Nodes0) ->
    Names = case Sel of
                default -> convoy_bench_scenarios:default_selection();
                L -> L
            end,
    {Scenarios, Nodes1} =
        lists:mapfoldl(fun(Name, N0) ->
                               Spec = spec(Name, Opts),
                               scenario(Spec, convoy_bench_runner:variants_for(Spec, Variants),
                                        RunOpts, N0)
                       end, Nodes0, Names),
    {Confirmed, Nodes} = confirm(Opts, Variants, RunOpts, Scenarios, Nodes1),
    {#{scenarios => Confirmed, variants => Variants}, Nodes};
body(Opts = #{command := tune, tune := Name}, _Variants, RunOpts, Nodes0) ->
    Spec = spec(Name, Opts),
    BaseName = convoy_bench_runner:baseline(Spec),
    [Base] = [V || V = #{name := N} <- variants(Opts#{only := all}), N =:= BaseName],
    {Tune, {Used, _, _} = Final, Nodes} = convoy_bench_tune:tune(Spec, Base, RunOpts, Nodes0),
    {#{scenarios => [scenario_result(Spec, Final, RunOpts)], tune => Tune, variants => Used},
     Nodes}.

%% --check --confirm N: cells outside tolerance measured N more times (see
%% convoy_bench_confirm).
confirm(#{check := true, confirm := N}, Variants, RunOpts, Scenarios, Nodes) when N > 0 ->
    convoy_bench_confirm:confirm(N, Variants, RunOpts, Scenarios, Nodes);
confirm(_Opts, _Variants, _RunOpts, Scenarios, Nodes) ->
    {Scenarios, Nodes}.

spec(Name, #{size := Size, params := P}) ->
    convoy_bench_scenarios:spec(Name, Size, P).

scenario(Spec, Variants, RunOpts, Nodes0) ->
    T0 = erlang:monotonic_time(),
    {Runs, Nodes} = convoy_bench_runner:run(Spec, Variants, RunOpts, Nodes0),
    Secs = erlang:convert_time_unit(erlang:monotonic_time() - T0, native, millisecond) / 1000,
    {scenario_result(Spec, {Variants, Runs, Secs}, RunOpts), Nodes}.

scenario_result(Spec = #{name := Name, title := Title}, {Variants, Runs, Secs}, _RunOpts) ->
    #{name => Name, title => Title, spec => Spec, seconds => Secs,
      baseline => convoy_bench_runner:baseline(Spec),
      variants => [N || #{name := N} <- Variants],
      runs => Runs,
      summary => convoy_bench_runner:summarise(Spec, Variants, Runs)}.

finish(Opts, Facts, Body = #{variants := Variants}, T0) ->
    Dir = out_dir(Opts),
    Secs = erlang:convert_time_unit(erlang:monotonic_time() - T0, native, millisecond) / 1000,
    Result0 = with_check(Opts, Variants,
                         (maps:remove(variants, Body))#{config => config(Opts, Facts, Variants,
                                                                         Secs)}),
    {Files, Notes} = convoy_bench_report:write(Dir, Result0),
    Result = Result0#{dir => iolist_to_binary(Dir),
                      files => [iolist_to_binary(F) || F <- Files],
                      notes => Notes},
    case maps:get(quiet, Opts) of
        true -> ok;
        false ->
            io:put_chars(convoy_bench_report:table(Result0)),
            io:format("~nresults in ~s (~.1f s): ~s~n",
                      [Dir, Secs, lists:join(" ", [filename:basename(F) || F <- Files])]),
            [io:format("note: ~s~n", [N]) || N <- Notes]
    end,
    {ok, Result}.

%% --check: every cell of every convoy variant against its scenario's baseline;
%% with plain_again in the run, its cells too, as the run's noise (`noise').
with_check(#{check := true}, Variants, Result = #{scenarios := Scenarios}) ->
    Convoy = [N || #{name := N, kind := convoy} <- Variants],
    Result#{check => case [N || #{name := N, kind := plain_again} <- Variants] of
                         [] -> convoy_bench_check:check(Scenarios, Convoy);
                         Again -> convoy_bench_check:check(Scenarios, Convoy, Again)
                     end};
with_check(#{check := false}, _Variants, Result) ->
    Result.

nodes_note(#{nodes_note := Note}) when Note =/= undefined -> Note;
nodes_note(#{nodes := none, peer_args := PA}) ->
    iolist_to_binary(["OTP peer nodes on this host started by the harness ",
                      "(one set per flag family, connected over distribution)",
                      [[", extra flags: ", lists:join(" ", PA)] || PA =/= []]]);
nodes_note(#{nodes := Ns}) ->
    iolist_to_binary(["given nodes: ", lists:join(", ", [atom_to_list(N) || N <- Ns])]).

out_dir(#{out := undefined}) ->
    unique(filename:join(["bench", "results", binary_to_list(timestamp(file))]), 0);
out_dir(#{out := Dir}) ->
    Dir.

unique(Dir, 0) ->
    case filelib:is_file(Dir) of
        false -> Dir;
        true -> unique(Dir, 1)
    end;
unique(Dir, N) ->
    D = Dir ++ "-" ++ integer_to_list(N),
    case filelib:is_file(D) of
        false -> D;
        true -> unique(Dir, N + 1)
    end.

timestamp(Style) ->
    {{Y, Mo, D}, {H, Mi, S}} = calendar:local_time(),
    Fmt = case Style of
              file -> "~4..0b~2..0b~2..0b-~2..0b~2..0b~2..0b";
              human -> "~4..0b-~2..0b-~2..0b ~2..0b:~2..0b:~2..0b"
          end,
    iolist_to_binary(io_lib:format(Fmt, [Y, Mo, D, H, Mi, S])).

%%--------------------------------------------------------------------
%% Variants

%% @doc The variants parsed options ask for, in report order.
-spec variants(opts()) -> [convoy_bench_runner:variant()].
variants(#{convoy := Extra, only := Only, noise := Noise}) ->
    All = all_variants(Extra),
    case Only of
        all -> [V || V = #{kind := K} <- All, K =/= plain_again orelse Noise, K =/= guarded];
        Names -> [V || V = #{name := N, kind := K} <- All,
                       lists:member(N, Names) orelse (Noise andalso K =:= plain_again)]
    end.

%% Every variant, in report order (`plain_again' and `guarded' run only when
%% asked for).
all_variants(Extra) ->
    [#{name => <<"local">>, kind => local, family => default, mode => plain,
       convoy => off},
     #{name => <<"local_call">>, kind => local_call, family => default, mode => call,
       convoy => off},
     plain_variant(),
     #{name => <<"plain_again">>, kind => plain_again, family => default,
       mode => plain, convoy => off},
     #{name => <<"ceiling">>, kind => ceiling, family => default, mode => ceiling,
       convoy => off},
     #{name => <<"handover">>, kind => handover, family => default, mode => handover,
       convoy => off},
     #{name => <<"guarded">>, kind => guarded, family => default, mode => guarded,
       convoy => off},
     #{name => <<"send_many">>, kind => send_many, family => default, mode => send_many,
       convoy => #{}},
     #{name => <<"batch">>, kind => batch, family => default, mode => batch, convoy => #{}},
     #{name => <<"nodelay_false">>, kind => nodelay_false, family => nodelay_false,
       mode => plain, convoy => off},
     #{name => <<"delay_send">>, kind => delay_send, family => delay_send,
       mode => plain, convoy => off},
     #{name => <<"pg2">>, kind => pg2, family => default, mode => pg2, convoy => off},
     #{name => <<"manifold">>, kind => manifold, family => default, mode => manifold,
       convoy => off},
     convoy_variant(<<"convoy">>, #{})]
    ++ [convoy_variant(<<"convoy[", Text/binary, "]">>, S) || {Text, S} <- Extra].

plain_variant() ->
    #{name => <<"plain">>, kind => plain, family => default, mode => plain, convoy => off}.

%% @doc A convoy variant named `Name' with `Settings' over the defaults (also used
%% by convoy_bench_tune).
-spec convoy_variant(binary(), map()) -> convoy_bench_runner:variant().
convoy_variant(Name, Settings) ->
    #{name => Name, kind => convoy, family => default, mode => convoy, convoy => Settings}.

describe_variant(V = #{kind := Kind, family := F, convoy := C}) ->
    Base = maps:with([name, kind, family], V),
    Flags = [list_to_binary(X) || X <- convoy_bench_nodes:family_flags(F)],
    case Kind of
        convoy ->
            {ok, Full} = convoy_config:validate(C),
            Base#{flags => Flags, settings => Full, given => C};
        _ ->
            Base#{flags => Flags}
    end.
