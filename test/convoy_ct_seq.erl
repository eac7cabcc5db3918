%% A sequence collector for the Common Test suites: senders send `{seq, From, N}'
%% (or `{seq, From, N, Payload}') with N = 1, 2, ... per sender; the collector
%% counts them and records every number that is not the sender's previous one plus
%% one (a reordering, a loss or a duplicate). Event-shaped messages (`event/2')
%% carry the sender and N in their Id.
-module(convoy_ct_seq).

-export([start/1, collector/0, await/2, event/2]).

%% How many errors a report carries.
-define(SHOWN, 10).
%% An event's Id: sender x EVENT_SPAN + N.
-define(EVENT_SPAN, 1000000).

%% A collector on Node (which has this module's code).
-spec start(node()) -> pid().
start(Node) ->
    spawn(Node, ?MODULE, collector, []).

-spec collector() -> no_return().
collector() ->
    loop(#{}, 0, [], []).

loop(Last, Count, Errors, Waiters) ->
    receive
        {seq, From, Seq} ->
            seen(From, Seq, Last, Count, Errors, Waiters);
        {seq, From, Seq, _Payload} ->
            seen(From, Seq, Last, Count, Errors, Waiters);
        {event, Id, _User, #{k := Id}} when is_integer(Id) ->
            seen(Id div ?EVENT_SPAN, Id rem ?EVENT_SPAN, Last, Count, Errors, Waiters);
        {'$seq_await', Target, ReplyTo} ->
            answer(Last, Count, Errors, [{Target, ReplyTo} | Waiters])
    end.

seen(From, Seq, Last, Count, Errors, Waiters) ->
    Errors1 = case maps:get(From, Last, 0) of
                  Prev when Seq =:= Prev + 1 -> Errors;
                  Prev -> [{From, Prev, Seq} | Errors]
              end,
    answer(Last#{From => Seq}, Count + 1, Errors1, Waiters).

answer(Last, Count, Errors, Waiters) ->
    {Done, Left} = lists:partition(fun({T, _}) -> Count >= T end, Waiters),
    [R ! {'$seq_count', self(), Count, lists:sublist(lists:reverse(Errors), ?SHOWN)}
     || {_, R} <- Done],
    loop(Last, Count, Errors, Left).

%% @doc Message N (1, 2, ...) of sender number Sender as an event: a realistic
%% shape of about 350 bytes, `{event, Id, <<"user-42">>, #{k => Id, body => ...}}'.
-spec event(non_neg_integer(), pos_integer()) -> tuple().
event(Sender, N) when N < ?EVENT_SPAN ->
    Id = Sender * ?EVENT_SPAN + N,
    {event, Id, <<"user-42">>, #{k => Id, body => binary:copy(<<"abc">>, 100)}}.

%% @doc `{Count, FirstErrors}' once the collector holds at least Target messages;
%% fails the test case after 30 s.
-spec await(pid(), non_neg_integer()) -> {non_neg_integer(), list()}.
await(C, Target) ->
    C ! {'$seq_await', Target, self()},
    receive {'$seq_count', C, N, Errors} -> {N, Errors}
    after 30000 -> ct:fail({collector_short, C, Target})
    end.
