%% The harness's fan-out scenarios: one message to many processes on the sink
%% nodes, each round timed until every receiver has it. `fanout' sends to the
%% receivers' pids (a loop of `!', or `convoy:multicast/2' for the convoy
%% variants); `publish' to the members of a `pg' group (`convoy:publish/3', or
%% the two plain-OTP ways, a loop over `pg:get_members/2' and Phoenix.PubSub's
%% dispatcher per node). Receivers are counted on their own node, whose counter
%% tells the driver when all of them got the round.
-module(convoy_bench_fanout).

-export([measure/3]).
%% Spawned on the nodes taking part.
-export([fan_group/3, fan_counter/4, fan_receiver/1, fan_sender/1, pub_scope/1, pub_group/5,
         pub_dispatcher/2, pub_dispatch/2]).

-import(convoy_bench_measure, [timeout/1, secs/1]).

-define(PUB_SCOPE, convoy_bench_pg).

%% @doc One point of `fanout' or `publish' on the driver node.
-spec measure(fanout | publish, map(), convoy_bench_measure:ctx()) ->
          convoy_bench_measure:figures().
%% One message to R processes spread over the sink nodes, from each of S senders
%% per round.
measure(fanout, #{receivers := R, rounds := Rounds0, senders := S}, Ctx = #{sinks := Sinks}) ->
    Rounds = rounds(Rounds0, S),
    Shares = shares(R, length(Sinks)),
    Groups = [erpc:call(N, ?MODULE, fan_group, [Share, Share * S, self()])
              || {N, Share} <- lists:zip(Sinks, Shares)],
    Pids = lists:append([Ps || {_, Ps} <- Groups]),
    Counters = [C || {C, _} <- Groups],
    Send = fun(Msg) -> fan_send(Ctx, Pids, Msg) end,
    [{fanout, Times}] = rounds([{fanout, Send}], S, Rounds, Counters, Ctx),
    [exit(C, shutdown) || C <- Counters],
    round_figures(R * S, Times);
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
    Figures = rounds([{Way, fun(Msg) -> publish_once(Way, Scope, Group, Msg) end}
                      || Way <- Ways], S, Rounds, Counters, Ctx),
    [exit(P, shutdown) || P <- Counters ++ Dispatchers],
    Rates = [{Way, round_figures(M * S, Times)} || {Way, Times} <- Figures],
    [First | Others] = [F || {_, F} <- Rates],
    PerWay = [{list_to_atom(atom_to_list(W) ++ "_s"), D}
              || {W, #{deliveries_s := D}} <- Rates, W =/= convoy],
    maps:merge(lists:foldl(fun faster/2, First, Others), maps:from_list(PerWay)).

shares(R, K) ->
    [R div K + case I =< R rem K of true -> 1; false -> 0 end || I <- lists:seq(1, K)].

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
fan_send(#{mode := plain}, Pids, Msg) -> [P ! Msg || P <- Pids], ok.

%% Many senders send fewer rounds (each round delivers S times as much); at least 2.
rounds(Rounds, 1) -> Rounds;
rounds(Rounds, S) -> max(2, Rounds div S).

%% For each way {Name, Send}: a warm-up round, then Rounds timed ones, the ways'
%% rounds interleaved (so each meets the same machine). In a round every one of S
%% senders calls Send({fan, I}) once (the driver itself when S = 1), and the round
%% ends when every counter has seen its share. Returns each way's round durations
%% in seconds.
rounds(Ways, S, Rounds, Counters, Ctx) ->
    WithSenders = [{Name, Send, senders(Send, S)} || {Name, Send} <- Ways],
    [_ = round(0, Send, Senders, Counters, Ctx) || {_, Send, Senders} <- WithSenders],
    Timed = [[round(I, Send, Senders, Counters, Ctx) || {_, Send, Senders} <- WithSenders]
             || I <- lists:seq(1, Rounds)],
    [begin unlink(P), exit(P, shutdown) end || {_, _, Senders} <- WithSenders, P <- Senders],
    [{Name, [lists:nth(K, Row) || Row <- Timed]}
     || {K, {Name, _, _}} <- lists:zip(lists:seq(1, length(WithSenders)), WithSenders)].

senders(_Send, 1) -> [];
senders(Send, S) -> [spawn_link(?MODULE, fan_sender, [Send]) || _ <- lists:seq(1, S)].

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
