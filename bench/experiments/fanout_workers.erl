%% Experiment (not part of the harness): does a fan-out on the receiving node gain
%% from more than one delivering process? Node A sends, peers B and C hold the
%% receivers (each tells a counter on its node, as the harness's `fanout' does).
%% Ways, rounds interleaved in each repeat:
%%   convoy     convoy:multicast/2;
%%   {split, K} per node, the destinations cut into K chunks, each sent straight
%%              to one of K delivering processes there (the ideal of a design that
%%              splits an entry over K workers: no lane, no inbox checks);
%%   manifold   'Elixir.Manifold':send/2, when its beams are on the code path.
%% Cases: one sender to all receivers, and 100 senders each to its own 100.
%%
%% Run from the repository, with convoy compiled (`rebar3 compile'):
%%   erlc -o /tmp bench/experiments/fanout_workers.erl
%%   erl -sname fw -noshell -pa _build/default/lib/convoy/ebin -pa /tmp \
%%       [-pa MANIFOLD_EBIN -pa ELIXIR_LIB/elixir/ebin -pa ELIXIR_LIB/logger/ebin] \
%%       -s fanout_workers run -s init stop
-module(fanout_workers).

-export([run/0]).
%% Run on the peers.
-export([receivers/2, counter/2, workers/1]).

-define(REPEATS, 3).
-define(ROUNDS, 60).
-define(MSG, {fan, <<"user-42">>, #{k => 1}}).

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
    Counters = [erpc:call(N, ?MODULE, counter, [self(), Half]) || N <- Nodes],
    [RB, RC] = [erpc:call(N, ?MODULE, receivers, [Half, Ctr]) || {N, Ctr} <- lists:zip(Nodes, Counters)],
    Groups = groups(RB, RC, Per),
    Workers = maps:from_list([{K, #{B => erpc:call(B, ?MODULE, workers, [K]),
                                    C => erpc:call(C, ?MODULE, workers, [K])}}
                              || K <- [1, 2, 3]]),
    Rates = [[{W, rate(W, Groups, Workers, S * Per)} || W <- Ways] || _ <- lists:seq(1, ?REPEATS)],
    io:format("~s: deliveries/s, median of ~b repeats (each ~b rounds)~n", [Name, ?REPEATS, ?ROUNDS]),
    [io:format("  ~-12s ~8.3f M~n", [io_lib:format("~p", [W]), median([R || Row <- Rates, {W1, R} <- Row, W1 =:= W]) / 1.0e6])
     || W <- Ways],
    [exit(P, kill) || P <- RB ++ RC ++ Counters].

rate(Way, Groups, Workers, PerRound) ->
    Self = self(),
    Senders = [spawn_link(fun() -> sender(Way, G, Workers, Self) end) || G <- Groups],
    round_(Senders), % warm-up
    T0 = erlang:monotonic_time(),
    [round_(Senders) || _ <- lists:seq(1, ?ROUNDS)],
    Secs = erlang:convert_time_unit(erlang:monotonic_time() - T0, native, microsecond) / 1.0e6,
    [begin unlink(P), exit(P, kill) end || P <- Senders],
    PerRound * ?ROUNDS / Secs.

round_(Senders) ->
    [P ! go || P <- Senders],
    [receive done -> ok end || _ <- [1, 2]].

sender(Way, G, Workers, Driver) ->
    receive go -> send(Way, G, Workers) end,
    sender(Way, G, Workers, Driver).

send(convoy, G, _) -> convoy:multicast(G, ?MSG);
send(manifold, G, _) -> 'Elixir.Manifold':send(G, ?MSG);
send({split, K}, G, Workers) ->
    ByNode = maps:groups_from_list(fun erlang:node/1, G),
    maps:foreach(fun(N, Ps) -> chunks(maps:get(N, maps:get(K, Workers)), Ps, K) end, ByNode).

chunks(Ws, Ps, K) ->
    Size = (length(Ps) + K - 1) div K,
    chunks_to(Ws, Ps, Size).

chunks_to([W | Ws], Ps, Size) when length(Ps) > Size, Ws =/= [] ->
    {Now, Later} = lists:split(Size, Ps),
    W ! {Now, ?MSG},
    chunks_to(Ws, Later, Size);
chunks_to([W | _], Ps, _Size) ->
    W ! {Ps, ?MSG}.

%% Each sender's receivers, half on B and half on C, taking turns.
groups([], [], _Per) -> [];
groups(RB, RC, Per) ->
    {B1, RB1} = lists:split(Per div 2, RB),
    {C1, RC1} = lists:split(Per div 2, RC),
    [lists:append([[X, Y] || {X, Y} <- lists:zip(B1, C1)]) | groups(RB1, RC1, Per)].

median(L) -> lists:nth((length(L) + 1) div 2, lists:sort(L)).

%% On the peers.
receivers(N, Counter) ->
    [spawn(fun() -> receiver(Counter) end) || _ <- lists:seq(1, N)].

receiver(Counter) ->
    receive _ -> Counter ! hit end,
    receiver(Counter).

counter(Driver, PerRound) ->
    spawn(fun() -> count(Driver, PerRound, PerRound) end).

count(Driver, PerRound, 0) -> Driver ! done, count(Driver, PerRound, PerRound);
count(Driver, PerRound, Left) -> receive hit -> count(Driver, PerRound, Left - 1) end.

workers(K) ->
    [spawn(fun worker/0) || _ <- lists:seq(1, K)].

worker() ->
    receive {Pids, Msg} -> [P ! Msg || P <- Pids] end,
    worker().
