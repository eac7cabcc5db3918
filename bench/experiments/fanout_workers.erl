%% Experiment (not part of the harness): does a fan-out on the receiving node gain
%% from more than one delivering process? Node A sends, peers B and C hold the
%% receivers: the harness's own (`convoy_bench_fanout:fan_group/3', each tells a
%% counter on its node), each message `{fan, Round}' as in `fanout'.
%% Ways, rounds interleaved in each repeat:
%%   convoy     convoy:multicast/2;
%%   {split, K} per node, the destinations cut into K chunks, each sent straight
%%              to one of K delivering processes there (the ideal of a design that
%%              splits an entry over K workers: no lane, no inbox checks);
%%   manifold   'Elixir.Manifold':send/2, when its beams are on the code path.
%% Cases: one sender to all receivers, and 100 senders each to its own 100.
%%
%% Run from the repository, with the harness compiled (`rebar3 as bench compile'):
%%   erlc -o /tmp bench/experiments/fanout_workers.erl
%%   erl -sname fw -noshell -pa _build/bench/lib/convoy/ebin \
%%       -pa _build/bench/lib/convoy/bench -pa /tmp \
%%       [-pa MANIFOLD_EBIN -pa ELIXIR_LIB/elixir/ebin -pa ELIXIR_LIB/logger/ebin] \
%%       -s fanout_workers run -s init stop
-module(fanout_workers).

-export([run/0]).
%% Run on the peers.
-export([workers/1]).

-define(REPEATS, 3).
-define(ROUNDS, 60).

run() ->
    Peers = [peer_node(N) || N <- [fw_b, fw_c]],
    Nodes = [N || {_, N} <- Peers],
    {ok, _} = application:ensure_all_started(convoy),
    [{ok, _} = erpc:call(N, application, ensure_all_started, [convoy]) || N <- Nodes],
    Manifold = [manifold || started(manifold, [node() | Nodes])],
    Ways = [convoy, {split, 1}, {split, 2}, {split, 3}] ++ Manifold,
    [case_(Name, S, Per, Ways, Nodes) || {Name, S, Per} <- [{"1 sender x 10000", 1, 10000},
                                                            {"100 senders x own 100", 100, 100}]],
    [peer:stop(P) || {P, _} <- Peers],
    ok.

peer_node(Name) ->
    {ok, P, N} = peer:start_link(#{name => Name, args => ["-pa" | code:get_path()]}),
    {P, N}.

started(App, Nodes) ->
    lists:all(fun(N) ->
                      case erpc:call(N, application, ensure_all_started, [App]) of
                          {ok, _} -> true;
                          {error, _} -> false
                      end
              end, Nodes).

case_(Name, S, Per, Ways, Nodes = [B, C]) ->
    Half = S * Per div 2,
    [{CB, RB}, {CC, RC}] = [erpc:call(N, convoy_bench_fanout, fan_group, [Half, Half, self()])
                            || N <- Nodes],
    Groups = groups(RB, RC, Per),
    Workers = maps:from_list([{K, #{B => erpc:call(B, ?MODULE, workers, [K]),
                                    C => erpc:call(C, ?MODULE, workers, [K])}}
                              || K <- [1, 2, 3]]),
    Rates = [[{W, rate(W, Groups, Workers, S * Per)} || W <- Ways] || _ <- lists:seq(1, ?REPEATS)],
    io:format("~s: deliveries/s, median of ~b repeats (each ~b rounds)~n", [Name, ?REPEATS, ?ROUNDS]),
    [io:format("  ~-12s ~8.3f M~n", [io_lib:format("~p", [W]), median([R || Row <- Rates, {W1, R} <- Row, W1 =:= W]) / 1.0e6])
     || W <- Ways],
    [exit(P, kill) || P <- [CB, CC]]. % its receivers are linked to it

rate(Way, Groups, Workers, PerRound) ->
    Self = self(),
    Senders = [spawn_link(fun() -> sender(Way, G, Workers, Self) end) || G <- Groups],
    round_(Senders, 0), % warm-up
    T0 = erlang:monotonic_time(),
    [round_(Senders, I) || I <- lists:seq(1, ?ROUNDS)],
    Secs = erlang:convert_time_unit(erlang:monotonic_time() - T0, native, microsecond) / 1.0e6,
    [begin unlink(P), exit(P, kill) end || P <- Senders],
    PerRound * ?ROUNDS / Secs.

round_(Senders, I) ->
    [P ! {go, I} || P <- Senders],
    [receive {fan_done, _} -> ok end || _ <- [1, 2]].

sender(Way, G, Workers, Driver) ->
    receive {go, I} -> send(Way, G, Workers, {fan, I}) end,
    sender(Way, G, Workers, Driver).

send(convoy, G, _, Msg) -> convoy:multicast(G, Msg);
send(manifold, G, _, Msg) -> 'Elixir.Manifold':send(G, Msg);
send({split, K}, G, Workers, Msg) ->
    ByNode = maps:groups_from_list(fun erlang:node/1, G),
    maps:foreach(fun(N, Ps) -> chunks(maps:get(N, maps:get(K, Workers)), Ps, K, Msg) end,
                 ByNode).

chunks(Ws, Ps, K, Msg) ->
    Size = (length(Ps) + K - 1) div K,
    chunks_to(Ws, Ps, Size, Msg).

chunks_to([W | Ws], Ps, Size, Msg) when length(Ps) > Size, Ws =/= [] ->
    {Now, Later} = lists:split(Size, Ps),
    W ! {Now, Msg},
    chunks_to(Ws, Later, Size, Msg);
chunks_to([W | _], Ps, _Size, Msg) ->
    W ! {Ps, Msg}.

%% Each sender's receivers, half on B and half on C, taking turns.
groups([], [], _Per) -> [];
groups(RB, RC, Per) ->
    {B1, RB1} = lists:split(Per div 2, RB),
    {C1, RC1} = lists:split(Per div 2, RC),
    [lists:append([[X, Y] || {X, Y} <- lists:zip(B1, C1)]) | groups(RB1, RC1, Per)].

median(L) -> lists:nth((length(L) + 1) div 2, lists:sort(L)).

%% On the peers: K delivering processes.
workers(K) ->
    [spawn(fun worker/0) || _ <- lists:seq(1, K)].

worker() ->
    receive {Pids, Msg} -> [P ! Msg || P <- Pids] end,
    worker().
