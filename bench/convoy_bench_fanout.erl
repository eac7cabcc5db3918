%% The harness's fan-out scenarios: one message to many processes on the sink
%% nodes, each round timed until every receiver has it. `fanout' sends to the
%% receivers' pids (a loop of `!', `convoy:multicast/2' for the convoy variants,
%% `Manifold.send/2' for the `manifold' variant); `publish' to the members of a
%% `pg' group (`convoy:publish/3', or the two plain-OTP ways, a loop over
%% `pg:get_members/2' and Phoenix.PubSub's dispatcher per node). Receivers are
%% counted on their own node, whose counter tells the driver when all of them got
%% the round.
%%
%% manifold (discord/manifold, Elixir) is built apart, by `make manifold-build',
%% into the repository's _build/manifold/ebin; its directory and Elixir's own are
%% added to the code path of every node of a `manifold' point, where it is started
%% (`manifold_paths/0', `start_manifold/1'). Each node's `Manifold.Partitioner'
%% takes the casts the sending node's `Manifold.send/2' makes, one per node, and
%% its workers send to that node's receivers.
-module(convoy_bench_fanout).

-export([measure/3, manifold_paths/0]).
%% Run on the nodes taking part.
-export([fan_group/3, fan_counter/4, fan_receiver/1, fan_sender/1, pub_scope/1, pub_group/5,
         pub_dispatcher/2, pub_dispatch/2, start_manifold/1]).

-import(convoy_bench_measure, [timeout/1, secs/1]).

-define(PUB_SCOPE, convoy_bench_pg).

%% @doc One point of `fanout' or `publish' on the driver node.
-spec measure(fanout | publish, map(), convoy_bench_measure:ctx()) ->
          convoy_bench_measure:figures().
%% One message to R processes spread over the sink nodes, from each of S senders
%% per round (`own' false); or S senders each to its own R div S of them, taken
%% from the sink nodes in turn (`own' true: a round delivers R messages in all,
%% as one sender's does, so it has as many rounds).
measure(fanout, #{receivers := R, rounds := Rounds0, senders := S, own := Own},
        Ctx = #{sinks := Sinks}) ->
    ok = ready(Ctx),
    {Receivers, PerReceiver, Rounds} = case Own of
                                           false -> {R, S, rounds(Rounds0, S)};
                                           true -> {S * (R div S), 1, Rounds0}
                                       end,
    Groups = [erpc:call(N, ?MODULE, fan_group, [Share, Share * PerReceiver, self()])
              || {N, Share} <- lists:zip(Sinks, shares(Receivers, length(Sinks)))],
    PerSink = [Ps || {_, Ps} <- Groups],
    Counters = [C || {C, _} <- Groups],
    Send = fun(Pids) -> fun(Msg) -> fan_send(Ctx, Pids, Msg) end end,
    Sends = case Own of
                false -> lists:duplicate(S, Send(lists:append(PerSink)));
                true -> [Send(Mine) || Mine <- chunks(R div S, interleave(PerSink))]
            end,
    [{fanout, Times}] = rounds([{fanout, Sends}], Rounds, Counters, Ctx),
    [exit(C, shutdown) || C <- Counters],
    round_figures(Receivers * PerReceiver, Times);
%% A pg group of M members spread over the sink nodes; S senders each publish one
%% message per round. Plain modes measure both plain-OTP ways, a loop of `!' over
%% pg:get_members/2 and Phoenix.PubSub's (one message per node to a dispatcher
%% there, which sends to pg:get_local_members/2), their rounds interleaved, and
%% report the better one as deliveries/s; convoy modes use convoy:publish/3.
measure(publish, #{members := M, senders := S, rounds := Rounds0}, Ctx = #{sinks := Sinks}) ->
    Rounds = rounds(Rounds0, S),
    Scope = ?PUB_SCOPE,
    Group = {convoy_bench_publish, make_ref()},
    Nodes = lists:usort([node() | Sinks]),
    [ok = erpc:call(N, ?MODULE, pub_scope, [Scope]) || N <- Nodes],
    Groups = [erpc:call(N, ?MODULE, pub_group, [Scope, Group, Share, Share * S, self()])
              || {N, Share} <- lists:zip(Sinks, shares(M, length(Sinks)))],
    Dispatchers = [erpc:call(N, ?MODULE, pub_dispatcher, [Scope, Group])
                   || N <- lists:usort(Sinks)],
    Counters = [C || {C, _} <- Groups],
    await_members(Scope, Group, M, Ctx),
    await_members(Scope, {dispatch, Group}, length(Dispatchers), Ctx),
    Ways = case maps:get(mode, Ctx) of
               convoy -> [convoy];
               plain -> [loop, dispatch]
           end,
    Publish = fun(Way) -> fun(Msg) -> publish_once(Way, Scope, Group, Msg) end end,
    Figures = rounds([{Way, lists:duplicate(S, Publish(Way))} || Way <- Ways], Rounds, Counters,
                     Ctx),
    [exit(P, shutdown) || P <- Counters ++ Dispatchers],
    Rates = [{Way, round_figures(M * S, Times)} || {Way, Times} <- Figures],
    [First | Others] = [F || {_, F} <- Rates],
    PerWay = [{list_to_atom(atom_to_list(W) ++ "_s"), D}
              || {W, #{deliveries_s := D}} <- Rates, W =/= convoy],
    maps:merge(lists:foldl(fun faster/2, First, Others), maps:from_list(PerWay)).

shares(R, K) ->
    [R div K + case I =< R rem K of true -> 1; false -> 0 end || I <- lists:seq(1, K)].

%% The lists' elements, one of each in turn: [B1, C1, B2, C2, ...].
interleave(Lists) ->
    case [L || L <- Lists, L =/= []] of
        [] -> [];
        Left -> [H || [H | _] <- Left] ++ interleave([T || [_ | T] <- Left])
    end.

%% `L' cut into lists of `N' (its length a multiple of N).
chunks(_N, []) -> [];
chunks(N, L) ->
    {Chunk, Rest} = lists:split(N, L),
    [Chunk | chunks(N, Rest)].

%% @doc On a sink node: a counter with `Share' receivers, which tells the driver
%% each time they got `PerRound' messages between them; returns them.
-spec fan_group(non_neg_integer(), non_neg_integer(), pid()) -> {pid(), [pid()]}.
fan_group(Share, PerRound, Driver) ->
    Self = self(),
    Counter = spawn(?MODULE, fan_counter, [Share, PerRound, Driver, Self]),
    receive {fan_ready, Counter, Pids} -> {Counter, Pids} end.

%% @doc Counts receivers' hits; tells the driver when all of them got a round.
-spec fan_counter(non_neg_integer(), non_neg_integer(), pid(), pid()) -> ok.
fan_counter(Share, PerRound, Driver, ReplyTo) ->
    process_flag(message_queue_data, off_heap),
    Self = self(),
    Pids = [spawn_link(?MODULE, fan_receiver, [Self]) || _ <- lists:seq(1, Share)],
    ReplyTo ! {fan_ready, Self, Pids},
    fan_count(PerRound, PerRound, Driver).

fan_count(Share, 0, Driver) ->
    Driver ! {fan_done, self()},
    fan_count(Share, Share, Driver);
fan_count(Share, Left, Driver) ->
    receive hit -> fan_count(Share, Left - 1, Driver) end.

%% @doc One of the fan-out receivers.
-spec fan_receiver(pid()) -> no_return().
fan_receiver(Counter) ->
    receive {fan, _} -> Counter ! hit end,
    fan_receiver(Counter).

fan_send(#{mode := convoy}, Pids, Msg) -> convoy:multicast(Pids, Msg);
fan_send(#{mode := manifold}, Pids, Msg) -> 'Elixir.Manifold':send(Pids, Msg);
fan_send(#{mode := plain}, Pids, Msg) -> [P ! Msg || P <- Pids], ok.

%% A manifold point starts manifold on every node taking part first.
ready(#{mode := manifold, sinks := Sinks}) ->
    case manifold_paths() of
        {ok, Dirs} ->
            lists:foreach(fun(N) -> ok = erpc:call(N, ?MODULE, start_manifold, [Dirs]) end,
                          [node() | Sinks]);
        {error, Why} ->
            exit({manifold_missing, Why})
    end;
ready(_Ctx) ->
    ok.

%% @doc The directories manifold needs on the code path, on this node's file
%% system: its beams and `manifold.app' (`make manifold-build' puts them in the
%% repository's _build/manifold/ebin) and Elixir's own `elixir' and `logger'.
%% `{error, Why}' (one line for the report, saying how to build) when some are
%% missing.
-spec manifold_paths() -> {ok, [file:filename()]} | {error, binary()}.
manifold_paths() ->
    Ebin = filename:join([convoy_bench_pubsub:root(), "_build", "manifold", "ebin"]),
    case filelib:is_regular(filename:join(Ebin, "manifold.app")) of
        false ->
            {error, iolist_to_binary(["manifold is not built (no ", Ebin, "/manifold.app): "
                                      "run `make manifold-build`"])};
        true ->
            case convoy_bench_pubsub:elixir_paths() of
                {ok, Elixir} -> {ok, [Ebin | Elixir]};
                {error, _} = E -> E
            end
    end.

%% @doc On each node of a manifold point: `Dirs' on the code path and manifold
%% started (left running after the point: idle, its processes only wait for casts).
-spec start_manifold([file:filename()]) -> ok.
start_manifold(Dirs) ->
    ok = code:add_pathsz(Dirs),
    {ok, _} = application:ensure_all_started(manifold),
    ok.

%% Many senders send fewer rounds (each round delivers S times as much); at least 2.
rounds(Rounds, 1) -> Rounds;
rounds(Rounds, S) -> max(2, Rounds div S).

%% For each way {Name, Sends}: a warm-up round, then Rounds timed ones, the ways'
%% rounds interleaved (so each meets the same machine). In a round each sender
%% calls its Send({fan, I}) once, one process per Send of Sends (the driver itself
%% when there is one), and the round ends when every counter has seen its share.
%% Returns each way's round durations in seconds.
rounds(Ways, Rounds, Counters, Ctx) ->
    WithSenders = [{Name, hd(Sends), senders(Sends)} || {Name, Sends} <- Ways],
    [_ = round(0, Send, Senders, Counters, Ctx) || {_, Send, Senders} <- WithSenders],
    Timed = [[round(I, Send, Senders, Counters, Ctx) || {_, Send, Senders} <- WithSenders]
             || I <- lists:seq(1, Rounds)],
    [begin unlink(P), exit(P, shutdown) end || {_, _, Senders} <- WithSenders, P <- Senders],
    [{Name, [lists:nth(K, Row) || Row <- Timed]}
     || {K, {Name, _, _}} <- lists:zip(lists:seq(1, length(WithSenders)), WithSenders)].

senders([_Send]) -> [];
senders(Sends) -> [spawn_link(?MODULE, fan_sender, [Send]) || Send <- Sends].

%% Deliveries per round over the median round: a few slow rounds (a scheduler
%% busy elsewhere on a shared machine) do not decide the figure.
round_figures(Deliveries, Times) ->
    Median = convoy_bench_stats:median(Times),
    #{round_ms => 1000 * Median, deliveries_s => Deliveries / Median}.

faster(F = #{deliveries_s := D}, #{deliveries_s := Best}) when D > Best -> F;
faster(_F, Best) -> Best.

round(I, Send, Senders, Counters, Ctx) ->
    T0 = erlang:monotonic_time(),
    case Senders of
        [] -> Send({fan, I});
        _ -> [P ! {go, I} || P <- Senders]
    end,
    [receive {fan_done, C} -> ok after timeout(Ctx) -> exit({timeout, fanout}) end
     || C <- Counters],
    secs(erlang:monotonic_time() - T0).

%% @doc One of many concurrent senders: `Send({fan, I})' on each `{go, I}'.
-spec fan_sender(fun((term()) -> term())) -> no_return().
fan_sender(Send) ->
    receive {go, I} -> Send({fan, I}) end,
    fan_sender(Send).

publish_once(convoy, Scope, Group, Msg) ->
    convoy:publish(Scope, Group, Msg);
publish_once(loop, Scope, Group, Msg) ->
    [P ! Msg || P <- pg:get_members(Scope, Group)],
    ok;
publish_once(dispatch, Scope, Group, Msg) ->
    [D ! {dispatch, Msg} || D <- pg:get_members(Scope, {dispatch, Group})],
    ok.

await_members(Scope, Group, N, Ctx) ->
    Deadline = erlang:monotonic_time(millisecond) + timeout(Ctx),
    await_members_until(Scope, Group, N, Deadline).

await_members_until(Scope, Group, N, Deadline) ->
    case length(pg:get_members(Scope, Group)) >= N of
        true ->
            ok;
        false ->
            erlang:monotonic_time(millisecond) < Deadline orelse exit({timeout, pg_members}),
            receive after 10 -> await_members_until(Scope, Group, N, Deadline) end
    end.

%% @doc On every node taking part in `publish': the pg scope (left running).
-spec pub_scope(atom()) -> ok.
pub_scope(Scope) ->
    case pg:start(Scope) of
        {ok, _} -> ok;
        {error, {already_started, _}} -> ok
    end.

%% @doc On a sink node: `fan_group/3' whose receivers join `Group'.
-spec pub_group(atom(), term(), non_neg_integer(), non_neg_integer(), pid()) -> {pid(), [pid()]}.
pub_group(Scope, Group, Share, PerRound, Driver) ->
    {C, Pids} = fan_group(Share, PerRound, Driver),
    ok = pg:join(Scope, Group, Pids),
    {C, Pids}.

%% @doc On a sink node: Phoenix.PubSub's dispatcher, one per node, a member of
%% `{dispatch, Group}'; sends what it gets to the node's members of `Group'.
-spec pub_dispatcher(atom(), term()) -> pid().
pub_dispatcher(Scope, Group) ->
    Self = self(),
    D = spawn(fun() ->
                      process_flag(message_queue_data, off_heap),
                      ok = pg:join(Scope, {dispatch, Group}, self()),
                      Self ! {joined, self()},
                      pub_dispatch(Scope, Group)
              end),
    receive {joined, D} -> D end.

%% @doc The dispatcher's loop.
-spec pub_dispatch(atom(), term()) -> no_return().
pub_dispatch(Scope, Group) ->
    receive {dispatch, Msg} -> [P ! Msg || P <- pg:get_local_members(Scope, Group)] end,
    pub_dispatch(Scope, Group).
